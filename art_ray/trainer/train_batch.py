"""A train call's data, prepared once: tokenized, split into optimizer steps, packed into rows and dealt
to the ranks. Rank 0 prepares it and returns one shard per rank through the object store, so no rank
tokenizes the whole batch again and every rank runs the same number of optimizer steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.trainer.batches import TokenizeStats, TokenSequence, sft_sequences, tokenize_groups
from art_ray.trainer.packing import PackedStep, pack_step
from art_ray.trajectories import Trajectory, TrajectoryGroup


@dataclass
class RankBatch:
    """One rank's share of a train call: each optimizer step's shared prefix and this rank's rows of it
    (possibly none: it then computes a zero-weight row to keep the collectives in step), each step's
    learning rate, and the call's token statistics. No steps: nothing in the call was trainable."""

    steps: list[PackedStep]
    learning_rates: list[float]
    stats: TokenizeStats


def rl_batches(
    groups: list[TrajectoryGroup],
    tokenizer: Any,
    config: TrainConfig,
    row_length: int,
    world_size: int,
    share_step_prefix: bool = True,
) -> list[RankBatch]:
    """GRPO: the trajectories split evenly into `num_gradient_steps` optimizer steps (a trajectory's
    sequences stay in one step), each step's token weights summing to 1."""
    sequences, stats = tokenize_groups(
        groups,
        tokenizer,
        scale_rewards=config.scale_rewards,
        plain_assistant=config.allow_training_without_logprobs,
        train_temperature=config.train_temperature,
    )
    trajectory_ids = sorted({sequence.trajectory_id for sequence in sequences})
    count = max(1, min(config.num_gradient_steps, len(trajectory_ids)))
    chunk = math.ceil(len(trajectory_ids) / count) if trajectory_ids else 1
    steps = []
    for index in range(count):
        members = set(trajectory_ids[index * chunk : (index + 1) * chunk])
        step = [sequence for sequence in sequences if sequence.trajectory_id in members]
        if step:
            steps.append(step)
    return _deal(steps, [config.learning_rate] * len(steps), stats, row_length, world_size, share_step_prefix)


def sft_batches(
    trajectories: list[Trajectory], tokenizer: Any, config: SFTConfig, row_length: int, world_size: int
) -> list[RankBatch]:
    """SFT: `batch_size` trajectories per optimizer step, in order; each step's loss is the mean
    cross-entropy of its assistant tokens."""
    per_trajectory, stats = sft_sequences(trajectories, tokenizer)
    learning_rates = config.steps(len(trajectories))
    size = math.ceil(len(trajectories) / len(learning_rates))
    steps, rates = [], []
    for index, rate in enumerate(learning_rates):
        step = [sequence for own in per_trajectory[index * size : (index + 1) * size] for sequence in own]
        if step:
            steps.append(step)
            rates.append(rate)
    return _deal(steps, rates, stats, row_length, world_size, share_step_prefix=True)


def _deal(
    steps: list[list[TokenSequence]],
    learning_rates: list[float],
    stats: TokenizeStats,
    row_length: int,
    world_size: int,
    share_step_prefix: bool,
) -> list[RankBatch]:
    shards = [RankBatch(steps=[], learning_rates=learning_rates, stats=stats) for _ in range(world_size)]
    for step in steps:
        total = sum(sequence.weight * sequence.num_trainable for sequence in step)
        for sequence in step:
            sequence.weight /= total
        packed = pack_step(step, row_length, share_step_prefix=share_step_prefix)
        for rank, shard in enumerate(shards):
            shard.steps.append(PackedStep(packed.rows[rank::world_size], packed.prefix))
    return shards
