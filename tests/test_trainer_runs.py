"""Runs sharing a trainer group: which configs may share, and the round-robin of their train calls."""

from __future__ import annotations

import asyncio

import pytest
from drivers import run_driver

from art_ray import ModelConfig
from art_ray.placement import Reservation
from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.group import RoundRobin
from art_ray.trainer.runs import group_key, shareable


def config(name: str, **settings) -> TrainerConfig:  # noqa: ANN003
    return TrainerConfig(
        model=name,
        project="p",
        base_model="/models/tiny",
        settings=ModelConfig(**settings),
        rank=Reservation(num_cpus=1.0),
    )


def test_runs_share_a_group_when_only_their_own_settings_differ() -> None:
    first = config("a", seed=0)
    assert group_key(first) == group_key(config("b", seed=3, adam_betas=(0.9, 0.95), weight_decay=0.1))
    assert group_key(first) == group_key(config("c", keep_versions=2).model_copy(update={"project": "q"}))
    assert group_key(first) != group_key(config("d", lora={"r": 32}))
    assert group_key(first) != group_key(config("e", sequence_length=512))
    assert group_key(first) != group_key(first.model_copy(update={"base_model": "/models/other"}))
    assert shareable(first) is None
    assert "zero_stage" in shareable(config("f", zero_stage=2))
    assert shareable(first.model_copy(update={"device": "gpu"})) is None


@pytest.mark.slow
def test_a_gpu_rank_swaps_runs_through_its_bf16_optimizer_wrapper_as_if_each_trained_alone() -> None:
    """The GPU trainer's engine (bf16 adapter, fp32 masters in DeepSpeed's mixed-precision wrapper) on the
    CPU accelerator: a run trained between two others' steps, swapped out each time, ends with exactly the
    adapter it gets on an engine of its own (tests/bf16_runs_driver.py)."""
    result = run_driver("bf16_runs_driver.py")
    assert result["wrapper"] == "FP16_UnfusedOptimizer" and result["masters_apart"], result
    assert result["moved"] > 1e-3, result  # three steps at lr 1e-2 moved the adapter
    assert result["max_difference"] == 0.0, result


def test_train_calls_take_turns_round_robin_across_runs_and_in_order_within_one() -> None:
    async def scenario() -> list[str]:
        turns = RoundRobin()
        served: list[str] = []
        release = asyncio.Event()

        async def call(run: str, label: str) -> None:
            async with turns.turn(run):
                served.append(label)
                if label == "a1":
                    await release.wait()  # the others queue meanwhile
                await asyncio.sleep(0)

        first = asyncio.create_task(call("a", "a1"))
        await asyncio.sleep(0)
        # run a queues three more calls before b and c queue one each: a busy run does not starve them
        rest = [
            asyncio.create_task(call(run, label))
            for run, label in (("a", "a2"), ("a", "a3"), ("a", "a4"), ("b", "b1"), ("c", "c1"))
        ]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, *rest)
        return served

    assert asyncio.run(scenario()) == ["a1", "b1", "c1", "a2", "a3", "a4"]


def test_a_cancelled_waiter_gives_its_turn_to_the_next() -> None:
    async def scenario() -> list[str]:
        turns = RoundRobin()
        served: list[str] = []
        hold = asyncio.Event()

        async def call(run: str) -> None:
            async with turns.turn(run):
                served.append(run)
                if run == "a":
                    await hold.wait()

        first = asyncio.create_task(call("a"))
        await asyncio.sleep(0)
        cancelled, last = asyncio.create_task(call("b")), asyncio.create_task(call("c"))
        await asyncio.sleep(0)
        cancelled.cancel()
        hold.set()
        await asyncio.gather(first, last)
        return served

    assert asyncio.run(scenario()) == ["a", "c"]


def test_only_a_rank_that_is_gone_restarts_the_ranks() -> None:
    """Found by the soak: a replica killed while a step was published failed the publish with the
    replica's ActorDiedError, raised through rank 0's task, and the backend restarted every shared rank
    and trained the call a second time."""
    from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

    from art_ray.backend import rank_died

    through_a_live_rank = RayTaskError("publish_adapter", "traceback", ActorDiedError()).as_instanceof_cause()
    assert isinstance(through_a_live_rank, RayActorError)  # what the backend catches
    assert not rank_died(through_a_live_rank)
    assert rank_died(ActorDiedError())
