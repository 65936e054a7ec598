"""The trainer group: world_size TrainerWorker actors in a placement group, driven as one.

After every train call rank 0's adapter is checkpointed and published to the serving replicas through
the LoRA registry as the next step; `train` returns when every live replica serves it.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from art_ray import storage
from art_ray.adapters.lora_files import write_peft_adapter
from art_ray.adapters.registry import publish_adapter
from art_ray.train_config import TrainConfig
from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.worker import TrainerWorker
from art_ray.trajectories import TrajectoryGroup

STATE_FILE = "trainer_state.json"


def checkpoint_steps(config: TrainerConfig) -> list[int]:
    """Steps with a complete checkpoint (the state file is written last), ascending."""
    root = f"{config.model_dir()}/checkpoints"
    steps = sorted(int(name) for name in storage.list_dir_names(root) if name.isdigit())
    return [step for step in steps if storage.exists(f"{config.checkpoint_dir(step)}/{STATE_FILE}")]


def latest_checkpoint(config: TrainerConfig) -> tuple[int, str] | None:
    steps = checkpoint_steps(config)
    return (steps[-1], config.checkpoint_dir(steps[-1])) if steps else None


class TrainerGroup:
    def __init__(self, config: TrainerConfig, publish: bool = True) -> None:
        self.config = config
        self.publish = publish
        # Ray rejects all-zero bundles; a rank that reserves nothing still needs a place to stand
        bundle = {"CPU": config.num_cpus_per_rank or 0.001}
        if config.num_gpus_per_rank:
            bundle["GPU"] = config.num_gpus_per_rank
        bundle.update(config.resources_per_rank)
        self._placement_group = placement_group([bundle] * config.world_size, strategy="PACK")
        self.workers = [
            ray.remote(TrainerWorker)
            .options(
                num_cpus=config.num_cpus_per_rank,
                num_gpus=config.num_gpus_per_rank,
                resources=dict(config.resources_per_rank),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(config.torch_threads)}},
            )
            .remote(config, rank)
            for rank in range(config.world_size)
        ]
        self.step = 0

    async def start(self) -> int:
        """Build the engines, resume from the latest checkpoint if there is one, publish the adapter."""
        await self._placement_group.ready()
        address, port = await self.workers[0].rendezvous.remote()
        await asyncio.gather(*(worker.setup.remote(address, port) for worker in self.workers))
        found = latest_checkpoint(self.config)
        if found is not None:
            steps = await asyncio.gather(
                *(worker.load_checkpoint.remote(found[1]) for worker in self.workers)
            )
            self.step = steps[0]
        if self.publish:
            await self._publish()
        return self.step

    async def train(
        self, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> AsyncIterator[dict[str, float]]:
        """Yield each gradient step's metrics as it finishes; then checkpoint and publish the new step."""
        for group in groups:
            for trajectory in group.trajectories:
                trajectory.check_trainable()
        streams = [
            worker.train.options(num_returns="streaming").remote(groups, config) for worker in self.workers
        ]
        followers = asyncio.gather(*(self._drain(stream) for stream in streams[1:]))
        async for ref in streams[0]:
            yield await ref
        await followers
        self.step = await self.workers[0].get_step.remote()
        start = time.perf_counter()
        await self._checkpoint()
        checkpoint_seconds = time.perf_counter() - start
        start = time.perf_counter()
        if self.publish:
            await self._publish()
        yield {
            "step": float(self.step),
            "time/checkpoint_seconds": checkpoint_seconds,
            "time/publish_seconds": time.perf_counter() - start,
        }

    @staticmethod
    async def _drain(stream) -> None:  # type: ignore[no-untyped-def]
        async for ref in stream:
            await ref

    async def _adapter(self) -> dict:
        if self.config.zero_stage == 3:  # every rank takes part in the gather
            return (await asyncio.gather(*(w.adapter_tensors.remote() for w in self.workers)))[0]
        return await self.workers[0].adapter_tensors.remote()

    async def _checkpoint(self) -> None:
        folder = self.config.checkpoint_dir(self.step)
        await asyncio.gather(*(worker.save_checkpoint.remote(folder) for worker in self.workers))
        adapter = await self._adapter()
        with tempfile.TemporaryDirectory() as staging:
            write_peft_adapter(Path(staging) / "adapter", adapter, self.config.lora, self.config.base_model)
            storage.upload_dir(Path(staging), folder)
        # written last: a folder without it is an interrupted checkpoint and is never resumed from
        storage.write_text(f"{folder}/{STATE_FILE}", json.dumps({"step": self.step, "saved_at": time.time()}))

    async def _publish(self) -> int:
        return await publish_adapter(
            self.config.model, self.step, self.config.base_model, self.config.lora, await self._adapter()
        )

    async def adapter_tensors(self) -> dict:
        return await self._adapter()

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self._placement_group)
