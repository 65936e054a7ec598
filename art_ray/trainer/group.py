"""The trainer group: world_size TrainerWorker actors in a placement group, driven as one.

The ranks (`TrainerRanks`) may hold several runs of one base model (art_ray/trainer/runs.py); each run
drives them through its own `TrainerGroup`, one train call at a time across runs, round-robin. After
every train call rank 0's adapter is published to the serving replicas through the LoRA registry as the
run's next step; `train` returns when every live replica serves it. The checkpoint is written in the
background meanwhile (the ranks write it before they run anything else), and marked complete last.
Colocated, the engines give the devices to the trainer for the train call and take them back after.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from art_ray import storage
from art_ray.adapters.registry import get_registry
from art_ray.cluster_actors import LONG_LIVED_OPTIONS, NAMESPACE
from art_ray.cpu_threads import trainer_openmp_env
from art_ray.errors import QuotaExceededError
from art_ray.placement import PlacementError
from art_ray.tinker.types import AdamStep, ForwardBackwardCall, ForwardBackwardResult, TinkerUserError
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.train_result import GradientStep, TrainEvent, TrainResult
from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.runs import group_key, shareable
from art_ray.trainer.worker import ADAPTER_GROUP, CHECKPOINT_GROUP, STATE_FILE, TrainerWorker
from art_ray.trajectories import Trajectory, TrajectoryGroup


def checkpoint_steps(config: TrainerConfig) -> list[int]:
    """Steps with a complete checkpoint (the state file is written last), ascending."""
    root = f"{config.model_dir()}/checkpoints"
    steps = sorted(int(name) for name in storage.list_dir_names(root) if name.isdigit())
    return [step for step in steps if storage.exists(f"{config.checkpoint_dir(step)}/{STATE_FILE}")]


def latest_checkpoint(config: TrainerConfig) -> tuple[int, str] | None:
    steps = checkpoint_steps(config)
    return (steps[-1], config.checkpoint_dir(steps[-1])) if steps else None


TRAINER_NAME_PREFIX = "art_ray_trainer:"


def trainer_actor_name(config: TrainerConfig) -> str:
    """Rank 0's actor name: the founding run's and a random suffix (a restarted group's differs)."""
    return f"{TRAINER_NAME_PREFIX}{config.model}:{uuid.uuid4().hex[:8]}"


class TrainerRanks:
    """The ranks of a trainer group (world_size TrainerWorker actors in a placement group) and the runs
    they hold (art_ray/trainer/runs.py). Train calls take turns: one run's at a time, in each run's own
    order, round-robin across the runs that have one waiting, so no run waits behind a busy one."""

    def __init__(self, config: TrainerConfig, placement_timeout_s: float = 60.0) -> None:
        self.founder = config
        self._placement_timeout_s = placement_timeout_s
        # Ray rejects all-zero bundles; a rank that reserves nothing still needs a place to stand
        bundle = config.rank.demand() or {"CPU": 0.001}
        self._placement_group = placement_group([bundle] * config.settings.world_size, strategy="PACK")
        # CPU ranks on every core pin a thread per core; a GPU rank only caps its host threads
        env = trainer_openmp_env(config.threads) if config.device == "cpu" or config.threads else {}
        # the plan decided the device: DeepSpeed's own probe would warn that it "was unable to detect" a GPU
        env["DS_ACCELERATOR"] = "cpu" if config.device == "cpu" else "cuda"
        self.workers = [
            ray.remote(concurrency_groups={ADAPTER_GROUP: 1, CHECKPOINT_GROUP: 1})(TrainerWorker)
            .options(
                num_cpus=config.rank.num_cpus,
                num_gpus=config.rank.num_gpus,
                resources=dict(config.rank.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env},
                **LONG_LIVED_OPTIONS,
                # rank 0 is named, so `art-ray status` finds every trainer on the cluster
                **({"name": trainer_actor_name(config), "namespace": NAMESPACE} if rank == 0 else {}),
            )
            .remote(config, rank)
            for rank in range(config.settings.world_size)
        ]
        self.runs: set[str] = {config.model}
        self._turns = RoundRobin()
        self._started: asyncio.Future[None] | None = None

    def accepts(self, config: TrainerConfig) -> bool:
        """Whether a run of `config` can train on these ranks."""
        return shareable(config) is None and group_key(config) == group_key(self.founder)

    async def start(self) -> None:
        """Place and set up the ranks (once; callers that come later wait for the first)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._setup())
        if not self._started.done():
            await asyncio.shield(self._started)
        self._started.result()  # the setup's error, for every caller

    async def _setup(self) -> None:
        try:
            await asyncio.wait_for(self._placement_group.ready(), self._placement_timeout_s)
        except TimeoutError:
            self.kill()
            raise PlacementError(
                f"the trainer of {self.founder.model!r} was not placed within "
                f"{self._placement_timeout_s:.0f} s "
                f"({self.founder.settings.world_size} x {self.founder.rank.demand()}); free those resources "
                "or change ModelConfig.trainer_cpus_per_rank / trainer_gpus_per_rank / world_size"
            ) from None
        address, port = await self.workers[0].rendezvous.remote()
        await asyncio.gather(*(worker.setup.remote(address, port) for worker in self.workers))

    async def add_run(self, config: TrainerConfig) -> None:
        await self.start()
        if config.model not in self.runs:
            await asyncio.gather(*(worker.add_run.remote(config) for worker in self.workers))
            self.runs.add(config.model)

    def release(self, run: str) -> None:
        """Take `run` off the ranks; they stop with their last run."""
        if run in self.runs and self.runs - {run}:  # the others go on: the ranks drop this run's state
            # a dead rank: the others' next call restarts the ranks
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get([worker.remove_run.remote(run) for worker in self.workers])
        self.runs.discard(run)
        if not self.runs:
            self.kill()

    def turn(self, run: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._turns.turn(run)

    def kill(self) -> None:
        """Stop every rank now (a group with a dead rank: the others may wait on it in a collective)."""
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self._placement_group)


class RoundRobin:
    """Turns for runs: FIFO within a run, and the next turn goes to the run after the last one served
    (in the order runs first asked) that has a caller waiting."""

    def __init__(self) -> None:
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._order: list[str] = []
        self._last: str | None = None
        self._busy = False

    @contextlib.asynccontextmanager
    async def turn(self, run: str) -> AsyncIterator[None]:
        if run not in self._order:
            self._order.append(run)
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(run, collections.deque()).append(granted)
        self._grant()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled: pass it on
                self._release()
            elif granted in self._waiting[run]:
                self._waiting[run].remove(granted)
            raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self._busy = False
        self._grant()

    def _grant(self) -> None:
        if self._busy:
            return
        start = self._order.index(self._last) + 1 if self._last in self._order else 0
        for run in self._order[start:] + self._order[:start]:
            queue = self._waiting.get(run, collections.deque())
            while queue and queue[0].done():  # cancelled before it was granted
                queue.popleft()
            if queue:
                self._busy, self._last = True, run
                queue.popleft().set_result(None)
                return


class TrainerGroup:
    """One run's trainer: its own ranks, or a share of another run's (`ranks`, art_ray/trainer/runs.py).

    After every train call rank 0's adapter is published to the serving replicas through the LoRA registry
    as the run's next step."""

    def __init__(
        self,
        config: TrainerConfig,
        publish: bool = True,
        placement_timeout_s: float = 60.0,
        ranks: TrainerRanks | None = None,
    ) -> None:
        self.config = config
        self.publish = publish
        self.ranks = ranks or TrainerRanks(config, placement_timeout_s)
        self.run = config.model
        self.step = 0
        self._checkpoint_written: ray.ObjectRef | None = None

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        return self.ranks.workers

    async def start(self) -> int:
        """Build the engines, resume from the latest checkpoint if there is one, publish the adapter."""
        await self.prepare()
        await self.publish_current()
        return self.step

    async def prepare(self) -> int:
        """Build the engines (or join the shared ranks) and resume from the run's latest checkpoint if there
        is one; publishes nothing, so it may run while the inference app is still starting."""
        await self.ranks.add_run(self.config)
        found = latest_checkpoint(self.config)
        if found is not None:
            async with self.ranks.turn(self.run):
                steps = await asyncio.gather(
                    *(worker.load_checkpoint.remote(self.run, found[1]) for worker in self.workers)
                )
            self.step = steps[0]
        return self.step

    async def publish_current(self) -> None:
        """Publish the current step's adapter and return once every live replica serves it."""
        if self.publish:
            registry = get_registry()
            async with self.ranks.turn(self.run):
                captured = [worker.publish_adapter.remote(self.run, registry) for worker in self.workers]
                published = await captured[0]
            await published[0]

    async def train(
        self, groups: list[TrajectoryGroup], config: TrainConfig, max_tokens: int | None = None
    ) -> AsyncIterator[TrainEvent]:
        """GRPO on the groups: yield each gradient step as it finishes; then publish the new step
        (checkpointing it in the background) and yield the TrainResult. QuotaExceededError, with nothing
        trained, when the call packs more than `max_tokens` tokens."""
        for group in groups:
            for trajectory in group.trajectories:
                trajectory.check_trainable()
        prepare = self.workers[0].prepare_rl.options(num_returns=len(self.workers))
        async for event in self._run(lambda: prepare.remote(groups, config, max_tokens), config):
            yield event

    async def train_sft(
        self, trajectories: list[Trajectory], config: SFTConfig, max_tokens: int | None = None
    ) -> AsyncIterator[TrainEvent]:
        """Supervised steps on the trajectories' assistant turns, then publish as `train` does."""
        for trajectory in trajectories:
            trajectory.check_trainable()
        config.steps(len(trajectories))  # a learning-rate list that does not fit fails before anything runs
        prepare = self.workers[0].prepare_sft.options(num_returns=len(self.workers))
        # With every old logprob missing (ratio 1) and advantage 1, CISPO's loss is the cross-entropy.
        loss_config = TrainConfig(policy_loss="cispo", max_grad_norm=config.max_grad_norm)
        async for event in self._run(lambda: prepare.remote(trajectories, config, max_tokens), loss_config):
            yield event

    async def _run(self, prepare: Callable[[], Any], config: TrainConfig) -> AsyncIterator[TrainEvent]:
        async with self.ranks.turn(self.run):
            gradient_steps = []
            async for gradient_step in self._train(prepare, config):
                gradient_steps.append(gradient_step)
                yield gradient_step
            published, timings = await self._publish_and_checkpoint()
        enqueued = time.perf_counter()
        if published is not None and config.wait_for_replicas:
            await published[0]
        timings["time/wait_for_replicas_seconds"] = time.perf_counter() - enqueued
        yield TrainResult.of(
            self.step, gradient_steps, timings, checkpoint_path=self.config.checkpoint_dir(self.step)
        )

    async def _train(self, prepare: Callable[[], Any], config: TrainConfig) -> AsyncIterator[GradientStep]:
        async with self._on_device():
            shards = prepare()  # rank 0 tokenizes and packs once; each rank is handed its own shard
            shards = shards if isinstance(shards, list) else [shards]
            streams = [
                worker.train.options(num_returns="streaming").remote(self.run, shard, config)
                for worker, shard in zip(self.workers, shards, strict=True)
            ]
            followers = asyncio.gather(*(self._drain(stream) for stream in streams[1:]))
            try:
                async for ref in streams[0]:
                    yield GradientStep(metrics=await ref)
                await followers
            except ray.exceptions.RayTaskError as error:
                followers.cancel()
                if isinstance(error.cause, QuotaExceededError):  # refused before any rank trained
                    raise QuotaExceededError(str(error.cause)) from None
                raise
            self.step = await self.workers[0].get_step.remote(self.run)

    @contextlib.asynccontextmanager
    async def _on_device(self) -> AsyncIterator[None]:
        """Colocated: the engines hand the devices to the trainer for the body and take them back after
        (on GPU once the trainer's memory is free)."""
        if not self.config.colocated:
            yield
            return
        await self._handover("release")
        try:
            yield
            if self.config.device == "gpu":
                await asyncio.gather(*(worker.offload.remote() for worker in self.workers))
        finally:
            await self._handover("reclaim")

    # --- the Tinker API: the run's calls, in the client's order (art_ray/tinker/) ---------------------

    async def tinker_forward_backward(self, call: ForwardBackwardCall) -> ForwardBackwardResult:
        """The call's per-datum logprobs and losses; its gradients wait for the run's optim_step."""
        async with self.ranks.turn(self.run), self._on_device():
            shards = await self._tinker_call(
                [worker.tinker_forward_backward.remote(self.run, call) for worker in self.workers]
            )
        outputs = dict(item for shard in shards for item in shard)
        ordered = [outputs[index] for index in range(len(call.data))]
        return ForwardBackwardResult(
            logprobs=[output.logprobs for output in ordered],
            elementwise_loss=[output.elementwise_loss for output in ordered],
            metrics={"loss:sum": sum(sum(output.elementwise_loss) for output in ordered)},
        )

    async def tinker_optim_step(self, step: AdamStep) -> dict[str, float]:
        async with self.ranks.turn(self.run):
            async with self._on_device():
                metrics = await self._tinker_call(
                    [worker.tinker_optim_step.remote(self.run, step) for worker in self.workers]
                )
                self.step = await self.workers[0].get_step.remote(self.run)
            # as a train call's step: a rank lost later does not take the step with it
            await self._start_checkpoint()
        return metrics[0]

    async def save_state(self, folder: str) -> None:
        """The run's full training state (adapter, optimizer, step, RNG) into `folder`; returns once it is
        complete on storage."""
        async with self.ranks.turn(self.run):
            await self.wait_for_checkpoint()
            saved = [worker.save_checkpoint.remote(self.run, folder) for worker in self.workers]
            written = [
                worker.checkpoint_written.remote(ref) for worker, ref in zip(self.workers, saved, strict=True)
            ]
        await self.workers[0].mark_checkpoint_complete.remote(folder, self.step, *written)

    async def load_state(self, folder: str, optimizer: bool, keep_step: bool = False) -> int:
        """A saved state into the run (without its optimizer state unless `optimizer`; the run keeps its
        own step if `keep_step`, read after a train call in flight); the run's step."""
        async with self.ranks.turn(self.run):
            as_step = self.step if keep_step else None
            steps = await asyncio.gather(
                *(
                    worker.load_checkpoint.remote(self.run, folder, optimizer, as_step)
                    for worker in self.workers
                )
            )
        self.step = steps[0]
        return self.step

    @staticmethod
    async def _tinker_call(calls: list[ray.ObjectRef]) -> list[Any]:
        try:
            return await asyncio.gather(*calls)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, TinkerUserError):  # every rank refuses it before computing
                raise TinkerUserError(str(error.cause)) from None
            raise

    async def _publish_and_checkpoint(self) -> tuple[list[ray.ObjectRef] | None, dict[str, float]]:
        """Publish the step and start its checkpoint; the publish call's refs (awaited by the caller, after
        its turn: the replicas load the adapter while another run trains)."""
        # The adapter goes from rank 0 to the object store and the registry pushes it; the checkpoint is
        # taken after the adapter capture, on each rank, and its files are written while the replicas load
        # the adapter and the next step trains.
        start = time.perf_counter()
        registry = get_registry() if self.publish else None
        captured = [worker.publish_adapter.remote(self.run, registry) for worker in self.workers]
        waited = await self._start_checkpoint()
        published = await captured[0]
        timings = {
            "time/checkpoint_wait_seconds": waited,
            "time/publish_enqueue_seconds": time.perf_counter() - start - waited,
        }
        return published, timings

    async def _start_checkpoint(self) -> float:
        """Start the current step's checkpoint, written while the next call runs; the seconds spent
        waiting for the last one first (one in flight at most: its files had this step's training to be
        written; a write's error, if any, surfaces here)."""
        waited = time.perf_counter()
        await self.wait_for_checkpoint()
        waited = time.perf_counter() - waited
        folder = self.config.checkpoint_dir(self.step)
        saved = [worker.save_checkpoint.remote(self.run, folder) for worker in self.workers]
        written = [
            worker.checkpoint_written.remote(ref) for worker, ref in zip(self.workers, saved, strict=True)
        ]
        # rank 0 marks it complete once every rank's files are written (Ray resolves `written` first)
        self._checkpoint_written = self.workers[0].mark_checkpoint_complete.remote(
            folder, self.step, *written
        )
        return waited

    async def wait_for_checkpoint(self) -> None:
        """Until the last train call's checkpoint is complete on storage."""
        if self._checkpoint_written is not None:
            await self._checkpoint_written
            self._checkpoint_written = None

    async def _handover(self, action: str) -> None:
        await get_registry().handover.remote(self.config.base_model, action)

    @staticmethod
    async def _drain(stream) -> None:  # type: ignore[no-untyped-def]
        async for ref in stream:
            await ref

    async def adapter_tensors(self) -> dict:
        """The current adapter, fetched to the caller (tests, tools; training never does this)."""
        async with self.ranks.turn(self.run):
            if self.config.settings.zero_stage == 3:  # every rank takes part in the gather
                return (await asyncio.gather(*(w.adapter_tensors.remote(self.run) for w in self.workers)))[0]
            return await self.workers[0].adapter_tensors.remote(self.run)

    async def leave(self) -> None:
        """Take the run off its ranks (registering it failed); the ranks stop with the last run."""
        await asyncio.to_thread(self.ranks.release, self.run)

    def shutdown(self, checkpoint_timeout_s: float = 300.0) -> None:
        """Wait for the run's last checkpoint; the ranks stop with the last run they hold."""
        if self._checkpoint_written is not None:  # a background write finishes before its writers go
            ray.get(self._checkpoint_written, timeout=checkpoint_timeout_s)
            self._checkpoint_written = None
        self.ranks.release(self.run)

    def kill(self) -> None:
        """Stop every rank now, whichever runs they hold (a group with a dead rank: the others may wait
        on it in a collective)."""
        self.ranks.kill()
