"""A deployed agent that learns from its own users: served, scored late, trained and released continuously.

    python examples/online/serve_and_learn.py --minutes 10
    python examples/online/serve_and_learn.py --minutes 10 --no-gates   # every trained step to everyone

SmolLM2-135M-Instruct is served under the run `online` with its traffic stored (ModelConfig.traffic). A
simulated population (examples/online/users.py) sends questions (each with its `user` and
`metadata["task"]`), likes one-word answers without saying so, and now and then sends a thumb late with
the response's feedback token. OnlineTrainer trains on the turns that feedback labeled, step after step;
with release gates (ModelConfig.release), each trained step first serves a share of the users and is
promoted or rolled back on what its turns show. Prints a row a minute: requests, the served replies' true
utility, the thumbs-up rate, the trained step and the release; as its last line one JSON object
{"example": "online", "first_utility", "last_utility", "steps", "rollbacks", "promotions", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from users import Population, utility  # noqa: E402

from art_ray import (  # noqa: E402
    LoRASpec,
    ModelConfig,
    OnlineTrainConfig,
    OnlineTrainer,
    RayBackend,
    ReleasePolicy,
    TrafficConfig,
    TrainableModel,
    TrainConfig,
)
from art_ray.releases import describe  # noqa: E402

MAX_TOKENS = 16


def online_model(args: argparse.Namespace) -> TrainableModel:
    release = None if args.no_gates else ReleasePolicy(stages=[0.25, 1.0], holdout=0.0, min_feedback=12)
    return TrainableModel(
        name=args.name,
        project="online",
        base_model=args.model,
        config=ModelConfig(
            lora=LoRASpec(r=16, alpha=32),
            sequence_length=512,
            max_model_len=512,
            max_num_seqs=32,
            traffic=TrafficConfig(mature_after_s=120, flush_s=10),
            release=release,
        ),
    )


class Minute:
    """What the users saw in one minute."""

    def __init__(self) -> None:
        self.utilities: list[float] = []
        self.thumbs: list[float] = []
        self.versions: dict[int, int] = {}


async def serve_population(model: TrainableModel, args: argparse.Namespace, minutes: list[Minute]) -> None:
    rng = random.Random(args.seed)
    population = Population.draw(
        rng, size=args.users, feedback_rate=args.feedback_rate, feedback_delay_s=args.feedback_delay_s
    )
    client = model.openai_client()
    started = time.monotonic()
    pending: set[asyncio.Task] = set()
    slots = asyncio.Semaphore(args.concurrency)

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
        minute = minutes[min(int((time.monotonic() - started) // 60), len(minutes) - 1)]
        minute.utilities.append(worth)
        version = (choice.model_extra or {}).get("policy_version", -1)
        minute.versions[version] = minute.versions.get(version, 0) + 1
        said = population.feedback(rng, user, worth, text)
        if said is not None:
            minute.thumbs.append(said[0])
            task = asyncio.create_task(
                later(said[1], reply.id, said[0], raw.headers.get("x-art-ray-feedback-token"))
            )
            pending.add(task)
            task.add_done_callback(pending.discard)

    deadline = started + args.minutes * 60
    while time.monotonic() < deadline:
        task = asyncio.create_task(one_request())
        pending.add(task)
        task.add_done_callback(pending.discard)
        await asyncio.sleep(rng.expovariate(args.rate))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def report(
    model: TrainableModel, minutes: list[Minute], trainer: OnlineTrainer, done: asyncio.Event
) -> None:
    print(
        f"{'minute':>6}  {'requests':>8}  {'utility':>7}  {'thumbs up':>9}  {'step':>4}  release", flush=True
    )
    for index in range(len(minutes)):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=60)
        minute = minutes[index]
        state = (await model.release()).release if model.config.release else None
        mean = statistics.fmean(minute.utilities) if minute.utilities else float("nan")
        thumbs = statistics.fmean(minute.thumbs) if minute.thumbs else float("nan")
        print(
            f"{index + 1:>6}  {len(minute.utilities):>8}  {mean:>7.3f}  {thumbs:>9.3f}  "
            f"{await model.get_step():>4}  {describe(state) if state else 'no gates'}",
            flush=True,
        )
        if done.is_set():
            return


async def main(args: argparse.Namespace) -> dict:
    backend = RayBackend(storage=args.storage, port=args.port)
    model = online_model(args)
    await model.register(backend)
    train = TrainConfig(
        learning_rate=args.learning_rate, scale_rewards=False, truncated_importance_sampling=2.0
    )
    trainer = OnlineTrainer(model, OnlineTrainConfig(min_turns=args.min_turns, poll_s=2.0, train=train))
    training = asyncio.create_task(trainer.run())
    minutes = [Minute() for _ in range(max(1, int(args.minutes)))]
    done = asyncio.Event()
    printing = asyncio.create_task(report(model, minutes, done))
    try:
        await serve_population(model, args, minutes)
    finally:
        done.set()
        trainer.request_stop()
        await asyncio.gather(training, printing, return_exceptions=True)
    decisions = trainer.release_decisions
    served = [m for m in minutes if m.utilities]
    result = {
        "example": "online",
        "gates": not args.no_gates,
        "first_utility": round(statistics.fmean(served[0].utilities), 3) if served else None,
        "last_utility": round(statistics.fmean(served[-1].utilities), 3) if served else None,
        "requests": sum(len(m.utilities) for m in minutes),
        "steps": await model.get_step(),
        "turns_trained": sum(r.grouping.trajectories for r in trainer.reports),
        "rollbacks": sum(d.action == "rollback" for d in decisions),
        "promotions": sum(d.action == "promote" for d in decisions),
    }
    backend.shutdown()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the users send requests")
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--feedback-rate", type=float, default=0.5, help="the share of replies a user scores")
    parser.add_argument("--feedback-delay-s", type=float, default=10.0, help="mean delay of a score")
    parser.add_argument("--min-turns", type=int, default=16, help="labeled turns per training step")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--no-gates", action="store_true", help="no release gates: each step to everyone")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="online")
    parser.add_argument("--storage", default="./art_ray_runs")
    parser.add_argument("--port", type=int, default=None, help="Serve's port (default: 8000 if free)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))), flush=True)
