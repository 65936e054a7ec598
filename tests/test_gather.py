"""gather_trajectory_groups and iterate_dataset: pure driver-side logic, no Ray."""

from __future__ import annotations

import asyncio

import pytest

from art_ray import (
    TooManyExceptionsError,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
    iterate_dataset,
)


async def rollout(reward: float, fail: bool = False, delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise ValueError(f"rollout {reward} failed")
    return Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)


def groups_with_failures(failures: set[int], size: int = 4, count: int = 2) -> list:
    return [
        TrajectoryGroup(rollout(g * size + i, fail=(g * size + i) in failures) for i in range(size))
        for g in range(count)
    ]


async def test_groups_keep_order_and_members():
    # the first group finishes last: order is the caller's, not completion order
    pending = [
        TrajectoryGroup(rollout(r, delay=0.05) for r in (1.0, 2.0)),
        TrajectoryGroup(rollout(r) for r in (3.0, 4.0, 5.0)),
    ]
    groups = await gather_trajectory_groups(pending, pbar_desc=None)
    assert [g.rewards for g in groups] == [[1.0, 2.0], [3.0, 4.0, 5.0]]


async def test_exceptions_within_budget_are_recorded_on_their_group():
    groups = await gather_trajectory_groups(groups_with_failures({1, 6}), max_exceptions=2, pbar_desc=None)
    assert [g.rewards for g in groups] == [[0.0, 2.0, 3.0], [4.0, 5.0, 7.0]]
    assert [len(g.exceptions) for g in groups] == [1, 1]
    assert groups[1].exceptions[0].type == "builtins.ValueError"
    assert groups[1].exceptions[0].message == "rollout 6 failed"


async def test_exceptions_beyond_budget_raise_with_the_first_failure_as_cause():
    with pytest.raises(TooManyExceptionsError, match="2 of 8") as raised:
        await gather_trajectory_groups(groups_with_failures({1, 6}), max_exceptions=1, pbar_desc=None)
    assert isinstance(raised.value.__cause__, ValueError)


async def test_fractional_budget_counts_all_rollouts():
    # 0.25 of 8 rollouts = 2 failures allowed, 3 are not
    groups = await gather_trajectory_groups(groups_with_failures({0, 5}), max_exceptions=0.25, pbar_desc=None)
    assert sum(len(g.exceptions) for g in groups) == 2
    with pytest.raises(TooManyExceptionsError):
        await gather_trajectory_groups(groups_with_failures({0, 5, 7}), max_exceptions=0.25, pbar_desc=None)


async def test_default_budget_is_zero():
    with pytest.raises(TooManyExceptionsError):
        await gather_trajectory_groups(groups_with_failures({3}), pbar_desc=None)


async def test_a_rollout_returning_the_wrong_type_is_a_failure():
    async def bad() -> str:
        return "not a trajectory"

    groups = await gather_trajectory_groups(
        [TrajectoryGroup([bad(), rollout(1.0)])], max_exceptions=1, pbar_desc=None
    )
    assert groups[0].rewards == [1.0]
    assert groups[0].exceptions[0].type == "builtins.TypeError"


async def test_after_each_can_drop_and_rewrite_groups():
    async def rescale(group: TrajectoryGroup) -> TrajectoryGroup | None:
        if min(group.rewards) == 0.0:
            return None  # drop the group that holds the zero reward
        return TrajectoryGroup(t.model_copy(update={"reward": t.reward * 10}) for t in group)

    pending = [TrajectoryGroup(rollout(r) for r in rewards) for rewards in ([0.0, 1.0], [2.0, 3.0])]
    groups = await gather_trajectory_groups(pending, after_each=rescale, pbar_desc=None)
    assert [g.rewards for g in groups] == [[20.0, 30.0]]


async def test_max_concurrency_bounds_rollouts_in_flight():
    in_flight = peak = 0

    async def tracked() -> Trajectory:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return await rollout(1.0)

    pending = [TrajectoryGroup(tracked() for _ in range(5)) for _ in range(4)]
    groups = await gather_trajectory_groups(pending, max_concurrency=3, pbar_desc=None)
    assert sum(len(g) for g in groups) == 20
    assert peak == 3


def test_iterate_dataset_resumes_where_it_stopped():
    items = list(range(10))
    full = list(iterate_dataset(items, groups_per_step=3, num_epochs=2, use_tqdm=False))
    assert len(full) == 8  # ceil(10 / 3) steps per epoch, the last one partial
    assert sorted(i for batch in full[:4] for i in batch.items) == items
    assert full[0].items != full[4].items  # a new shuffle per epoch
    resumed = list(iterate_dataset(items, groups_per_step=3, num_epochs=2, initial_step=5, use_tqdm=False))
    assert [(b.step, b.items) for b in resumed] == [(b.step, b.items) for b in full[5:]]
    with pytest.raises(ValueError):
        list(iterate_dataset(items, groups_per_step=0))
