"""Gathering rollouts into trajectory groups, as in ART: one exception budget, one progress bar.

`TrajectoryGroup(rollout(...) for _ in range(n))` is a pending group of coroutines; gathering runs all
rollouts of all groups concurrently on the driver's event loop, records failures on their group, and
raises once more rollouts failed than `max_exceptions` allows (a count, or a fraction of all rollouts).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from art_ray.trajectories import PendingTrajectoryGroup, Trajectory, TrajectoryGroup

AfterEach = Callable[[TrajectoryGroup], Any]


class TooManyExceptionsError(RuntimeError):
    """More rollouts failed than `max_exceptions` allows; the first failure is the cause."""


def _budget(max_exceptions: int | float, total: int) -> int:
    if isinstance(max_exceptions, float) and 0 <= max_exceptions < 1:
        return int(max_exceptions * total)
    return int(max_exceptions)


def _completion_tokens(trajectory: Trajectory) -> int:
    tokens = 0
    for history in trajectory.histories():
        for choice in history.trainable_choices():
            content = choice.logprobs.content if choice.logprobs else None
            tokens += len(content or [])
    return tokens


async def gather_trajectory_groups(
    groups: Iterable[PendingTrajectoryGroup | TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    pbar_desc: str | None = "gather",
    max_concurrency: int | None = None,
) -> list[TrajectoryGroup]:
    """Run every rollout of every group; return the groups in order.

    `after_each(group)` may return the group, a replacement group, or None to drop it (RULER plugs in
    here). `max_concurrency` bounds the rollouts in flight.
    """
    pending = [g if isinstance(g, PendingTrajectoryGroup | TrajectoryGroup) else await g for g in groups]
    total = sum(len(g.rollouts) if isinstance(g, PendingTrajectoryGroup) else 0 for g in pending)
    budget = _budget(max_exceptions, total)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=total, desc=pbar_desc, disable=pbar_desc is None)
    state = {"exceptions": 0, "tokens": 0, "reward_sum": 0.0, "done": 0}
    first_failure: list[BaseException] = []

    async def run(rollout: Awaitable[Trajectory]) -> Trajectory | BaseException:
        try:
            if semaphore is None:
                result = await rollout
            else:
                async with semaphore:
                    result = await rollout
            if not isinstance(result, Trajectory):
                raise TypeError(f"a rollout returned {type(result).__name__}, expected a Trajectory")
        except Exception as error:  # recorded on the group; the budget decides whether to stop
            state["exceptions"] += 1
            first_failure.append(error)
            bar.set_postfix(exceptions=state["exceptions"])
            bar.update(1)
            if state["exceptions"] > budget:
                raise TooManyExceptionsError(
                    f"{state['exceptions']} of {total} rollouts failed (max_exceptions={max_exceptions})"
                ) from first_failure[0]
            return error
        result.stamp_policy_versions()
        state["done"] += 1
        state["tokens"] += _completion_tokens(result)
        state["reward_sum"] += result.reward
        bar.set_postfix(reward=state["reward_sum"] / state["done"], completion_tokens=state["tokens"])
        bar.update(1)
        return result

    async def one_group(group: PendingTrajectoryGroup | TrajectoryGroup) -> TrajectoryGroup | None:
        if isinstance(group, PendingTrajectoryGroup):
            results = await asyncio.gather(*(run(rollout) for rollout in group.rollouts))
            built = TrajectoryGroup(
                [r for r in results if isinstance(r, Trajectory)],
                metadata=group.metadata,
                exceptions=[*group.exceptions, *(r for r in results if isinstance(r, BaseException))],
            )
        else:
            built = group
        if after_each is None:
            return built
        outcome = after_each(built)
        if inspect.isawaitable(outcome):
            outcome = await outcome
        return outcome

    tasks = [asyncio.ensure_future(one_group(group)) for group in pending]
    try:
        gathered = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    finally:
        bar.close()
    return [group for group in gathered if group is not None]
