"""iterate_dataset, like ART's: fixed-size batches over epochs, shuffled per epoch with a seed, so a
resumed run (initial_step = the model's step) continues exactly where it stopped."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tqdm.auto import tqdm

Item = TypeVar("Item")


@dataclass
class DatasetBatch(Generic[Item]):
    """One training step's share of a dataset (`iterate_dataset`): its items, the global step it is for,
    and where it falls in the epochs."""

    items: list[Item]
    step: int
    epoch: int
    epoch_step: int


def iterate_dataset(
    dataset: Sequence[Item],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
    seed: int = 42,
) -> Iterator[DatasetBatch[Item]]:
    """Yield batches of `groups_per_step` items; a partial last batch of an epoch is kept."""
    if groups_per_step < 1:
        raise ValueError("groups_per_step must be at least 1")
    steps_per_epoch = math.ceil(len(dataset) / groups_per_step)
    total = steps_per_epoch * num_epochs
    bar = tqdm(initial=initial_step, total=total, desc="steps", disable=not use_tqdm)
    for epoch in range(num_epochs):
        order = list(range(len(dataset)))
        random.Random(seed + epoch).shuffle(order)
        for epoch_step in range(steps_per_epoch):
            step = epoch * steps_per_epoch + epoch_step
            if step < initial_step:
                continue
            indices = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
            yield DatasetBatch([dataset[i] for i in indices], step, epoch, epoch_step)
            bar.update(1)
    bar.close()
