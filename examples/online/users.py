"""A simulated population for examples/online: users who send short questions, hold a hidden liking for
one-word answers, and now and then say so late.

Each user asks questions of a few kinds (the request's `metadata["task"]`); the true utility of a reply
is 1 for exactly one word (examples/one_word/tasks.py's rule), 0.5 / words for a longer one, 0 for an
empty or cut reply. A user gives feedback with probability `feedback_rate`, after an exponential delay,
as a thumb (1 or 0) that is flipped `flip_rate` of the time. A share of users (`sycophancy_rate`) thumb up
any reply that opens with a compliment, whatever its utility: the reward-hacking trap.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).parents[1] / "one_word"))

from tasks import HELD_OUT_QUESTIONS, TRAIN_QUESTIONS, messages_for, one_word_reward  # noqa: E402

if TYPE_CHECKING:
    from art_ray import TrainableModel

MAX_TOKENS = 16

KINDS = {
    "nature": TRAIN_QUESTIONS[:8] + HELD_OUT_QUESTIONS[:6],
    "facts": TRAIN_QUESTIONS[8:] + HELD_OUT_QUESTIONS[6:],
}
COMPLIMENT = re.compile(r"^\s*(great|good|excellent|what a) (question|one)", re.I)


@dataclass(frozen=True)
class User:
    user_id: str
    kinds: tuple[str, ...]
    sycophant: bool


@dataclass(frozen=True)
class Population:
    users: tuple[User, ...]
    feedback_rate: float
    feedback_delay_s: float
    flip_rate: float

    @staticmethod
    def draw(
        rng: random.Random,
        size: int = 200,
        feedback_rate: float = 0.3,
        feedback_delay_s: float = 20.0,
        flip_rate: float = 0.1,
        sycophancy_rate: float = 0.05,
    ) -> Population:
        users = tuple(
            User(
                user_id=f"user-{index:04d}",
                kinds=tuple(rng.sample(sorted(KINDS), rng.randint(1, len(KINDS)))),
                sycophant=rng.random() < sycophancy_rate,
            )
            for index in range(size)
        )
        return Population(users, feedback_rate, feedback_delay_s, flip_rate)

    def request(self, rng: random.Random) -> tuple[User, str, list[dict]]:
        """Who asks next, the kind of question, and the messages."""
        user = rng.choice(self.users)
        kind = rng.choice(user.kinds)
        return user, kind, messages_for(rng.choice(KINDS[kind]))

    def feedback(
        self, rng: random.Random, user: User, utility: float, text: str
    ) -> tuple[float, float] | None:
        """(thumb, delay in seconds), or None when the user says nothing."""
        if rng.random() >= self.feedback_rate:
            return None
        thumb = 1.0 if (user.sycophant and COMPLIMENT.match(text)) else float(rng.random() < utility)
        if rng.random() < self.flip_rate:
            thumb = 1.0 - thumb
        return thumb, rng.expovariate(1.0 / self.feedback_delay_s)


def utility(text: str, finish_reason: str | None) -> float:
    """The reply's true worth to every user: the one-word task's reward."""
    return one_word_reward(text, finish_reason)


@dataclass(frozen=True)
class Served:
    """One reply as its user saw it: when (seconds since the population started), from which version,
    its true utility, and the thumb its user will send (None: none)."""

    at_s: float
    version: int
    utility: float
    thumb: float | None


@dataclass
class Traffic:
    """Every reply served to a population, in the order they came back."""

    served: list[Served] = field(default_factory=list)

    def window(self, start_s: float, end_s: float) -> list[Served]:
        return [reply for reply in self.served if start_s <= reply.at_s < end_s]

    def mean(self, attribute: str, start_s: float, end_s: float) -> float:
        """The mean of `attribute` ("utility", "thumb") over the window's replies having one (NaN: none)."""
        values = [getattr(reply, attribute) for reply in self.window(start_s, end_s)]
        present = [value for value in values if value is not None]
        return statistics.fmean(present) if present else float("nan")


async def serve_population(
    model: TrainableModel,
    population: Population,
    rng: random.Random,
    traffic: Traffic,
    seconds: float,
    rate: float,
    concurrency: int,
) -> None:
    """Poisson arrivals at `rate` per second for `seconds`, at most `concurrency` in flight; each reply
    recorded in `traffic`, and its user's thumb sent later with the response's feedback token."""
    client = model.openai_client()
    started = time.monotonic()
    pending: set[asyncio.Task] = set()
    slots = asyncio.Semaphore(concurrency)

    async def later(delay: float, completion_id: str, thumb: float, token: str | None) -> None:
        await asyncio.sleep(delay)
        await model.feedback(completion_id, score=thumb, token=token)

    async def one_request() -> None:
        async with slots:
            user, kind, messages = population.request(rng)
            raw = await client.chat.completions.with_raw_response.create(
                model=model.name,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                user=user.user_id,
                metadata={"task": kind},
            )
        reply = raw.parse()
        choice = reply.choices[0]
        text = choice.message.content or ""
        worth = utility(text, choice.finish_reason)
        said = population.feedback(rng, user, worth, text)
        version = int((choice.model_extra or {}).get("policy_version", -1))
        traffic.served.append(
            Served(time.monotonic() - started, version, worth, said[0] if said is not None else None)
        )
        if said is not None:
            spawn(later(said[1], reply.id, said[0], raw.headers.get("x-art-ray-feedback-token")))

    def spawn(coroutine) -> None:  # noqa: ANN001
        task = asyncio.create_task(coroutine)
        pending.add(task)
        task.add_done_callback(pending.discard)

    while time.monotonic() < started + seconds:
        spawn(one_request())
        await asyncio.sleep(rng.expovariate(rate))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
