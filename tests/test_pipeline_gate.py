"""The pipelined loop's admission gate, as pure logic: a stand-in model whose `train` sleeps and counts, and
rollouts that sleep. The real stack runs the same loop in tests/test_pipeline.py.

- Rollouts start only for batches that may still train them: fast rollouts and a slow trainer sample no
  group only to drop it as stale (ART's queue bound alone sampled up to a queue and a worker's worth ahead).
- `max_steps_off_policy=0` is the sync loop: no rollout runs while a step trains.
- With a bound of 1, the next batch samples while the current one trains.
"""

from __future__ import annotations

import asyncio
import time

from art_ray import PipelineTrainer, Trajectory, TrajectoryGroup


class StandInModel:
    """What PipelineTrainer calls on a TrainableModel: get_step, train, log."""

    def __init__(self, train_seconds: float) -> None:
        self.step = 0
        self.train_seconds = train_seconds
        self.train_spans: list[tuple[float, float]] = []
        self.batch_ages: list[list[int]] = []

    async def get_step(self) -> int:
        return self.step

    async def train(self, groups: list[TrajectoryGroup], config: object, verbose: bool = True) -> int:
        started = time.monotonic()
        self.batch_ages.append([self.step - t.initial_policy_version for g in groups for t in g.trajectories])
        await asyncio.sleep(self.train_seconds)
        self.step += 1
        self.train_spans.append((started, time.monotonic()))
        return self.step

    async def log(self, groups: list, split: str = "val", metrics: dict | None = None) -> dict:
        return {}


class Rollouts:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spans: list[tuple[float, float]] = []

    async def __call__(self, model: StandInModel, scenario: int) -> TrajectoryGroup:
        started = time.monotonic()
        await asyncio.sleep(self.seconds)
        self.spans.append((started, time.monotonic()))
        messages = [{"role": "user", "content": str(scenario)}]
        return TrajectoryGroup(Trajectory(messages_and_choices=messages, reward=float(i)) for i in range(2))


def pipeline(model: StandInModel, rollouts: Rollouts, tmp_path, bound: int, steps: int) -> PipelineTrainer:  # noqa: ANN001
    return PipelineTrainer(
        model,  # type: ignore[arg-type]
        rollouts,
        range(1000),
        num_rollout_workers=8,
        min_batch_size=2,
        max_steps_off_policy=bound,
        max_steps=steps,
        state_path=str(tmp_path / "state.json"),
        verbose=False,
    )


async def test_fast_rollouts_sample_no_group_only_to_drop_it(tmp_path) -> None:
    model, rollouts = StandInModel(train_seconds=0.3), Rollouts(seconds=0.01)
    trainer = pipeline(model, rollouts, tmp_path, bound=1, steps=5)
    await trainer.train()
    assert trainer.state.groups_stale == 0
    assert all(age <= 1 for ages in model.batch_ages for age in ages)
    # 5 batches of 2, and nothing sampled for a step the run will not train
    assert trainer.state.groups_trained == 10
    assert len(rollouts.spans) == 10


async def test_a_bound_of_zero_is_the_sync_loop(tmp_path) -> None:
    model, rollouts = StandInModel(train_seconds=0.2), Rollouts(seconds=0.05)
    trainer = pipeline(model, rollouts, tmp_path, bound=0, steps=4)
    await trainer.train()
    for start, end in rollouts.spans:
        assert not any(start < t_end and t_start < end for t_start, t_end in model.train_spans)
    assert all(age == 0 for ages in model.batch_ages for age in ages)


async def test_a_bound_of_one_samples_the_next_batch_while_a_step_trains(tmp_path) -> None:
    model, rollouts = StandInModel(train_seconds=0.3), Rollouts(seconds=0.1)
    trainer = pipeline(model, rollouts, tmp_path, bound=1, steps=4)
    await trainer.train()
    # the first step trains while the second batch, sampled with the first, waits in the queue; the last
    # has no next batch
    for t_start, t_end in model.train_spans[1:-1]:
        assert any(start < t_end and t_start < end for start, end in rollouts.spans)
    assert trainer.state.groups_stale == 0
