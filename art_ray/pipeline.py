"""The pipelined training loop: rollouts keep running while the trainer trains (the split layout's loop).

Concepts and names follow ART 0.5's PipelineTrainer. Rollout workers take scenarios and run the user's
rollout function (on the driver's loop, or as Ray work inside it with `remote_rollout`), each making a
group; the training stage collects `min_batch_size` to `max_batch_size` groups and trains a step on them,
returning once the replicas serve the step (its checkpoint is written while the next step trains). Each
trajectory records the policy versions (trained steps) that sampled it; a group sampled more than
`max_steps_off_policy` steps before the policy it would train is dropped and counted, never trained (the
loss keeps the importance ratio against the sampling logprobs). A rollout starts only when the batches it
could still train in have room (`_may_start_rollout`), so the engine samples what the trainer will take
and no more. State (step, scenario offset, counters) is saved after every step, so a restarted run resumes
at the same step and scenario.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import pydantic

from art_ray.model import TrainableModel
from art_ray.train_config import TrainConfig
from art_ray.trajectories import TrajectoryGroup

Scenario = TypeVar("Scenario")
RolloutFn = Callable[[TrainableModel, Any], Awaitable[TrajectoryGroup]]
EvalFn = Callable[[TrainableModel, int], Awaitable[list[TrajectoryGroup]]]
STATE_FILE = "pipeline_state.json"


class PipelineState(pydantic.BaseModel):
    """What a restarted run needs: the step trained last and how many scenarios were taken."""

    step: int = 0
    scenario_offset: int = 0
    groups_trained: int = 0
    groups_stale: int = 0
    groups_without_signal: int = 0
    groups_failed: int = 0
    last_eval_step: int | None = None


class StepReport(pydantic.BaseModel):
    """One pipelined step, as printed in the step table and logged to MLflow (`pipeline/*`)."""

    step: int
    groups: int
    trajectories: int
    reward: float
    steps_off_policy_mean: float
    steps_off_policy_max: int
    groups_dropped_stale: int
    queue_depth: int
    engine_busy: float  # share of the step's wall time with at least one rollout in flight
    trainer_busy: float  # share of the step's wall time inside the train call
    seconds: float

    def metrics(self) -> dict[str, float]:
        names = ("steps_off_policy_mean", "steps_off_policy_max", "groups_dropped_stale", "queue_depth")
        return {
            **{f"pipeline/{name}": float(getattr(self, name)) for name in names},
            "pipeline/engine_busy_fraction": self.engine_busy,
            "pipeline/trainer_busy_fraction": self.trainer_busy,
            "pipeline/step_seconds": self.seconds,
        }


class _BusyClock:
    """Wall seconds during which at least one of some activities ran."""

    def __init__(self) -> None:
        self.active = 0
        self.total = 0.0
        self._since = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += time.perf_counter() - self._since

    def read(self) -> float:
        return self.total + (time.perf_counter() - self._since if self.active else 0.0)


class PipelineTrainer(Generic[Scenario]):
    """`rollout_fn(model, scenario)` returns a TrajectoryGroup (or a pending one, awaited here);
    `scenarios` is an iterable or async iterator; `eval_fn(model, step)` returns groups logged as "val"
    every `eval_every_n_steps` steps. `max_batch_size` defaults to `min_batch_size`; `max_steps` counts
    from the step the run starts at; `train_config` is each step's TrainConfig. `state_path` defaults to
    the model's folder for a RayBackend, `./.art_ray/{project}/{name}/` for other backends."""

    def __init__(
        self,
        model: TrainableModel,
        rollout_fn: RolloutFn,
        scenarios: Iterable[Scenario] | AsyncIterator[Scenario],
        *,
        train_config: TrainConfig | None = None,
        num_rollout_workers: int = 16,
        min_batch_size: int = 4,
        max_batch_size: int | None = None,
        max_steps_off_policy: int = 4,
        max_steps: int | None = None,
        eval_fn: EvalFn | None = None,
        eval_every_n_steps: int = 20,
        resume: bool = True,
        state_path: str | None = None,
        verbose: bool = True,
    ) -> None:
        if min_batch_size < 1 or num_rollout_workers < 1 or max_steps_off_policy < 0:
            raise ValueError("min_batch_size and num_rollout_workers must be >= 1, max_steps_off_policy >= 0")
        self.model = model
        self.rollout_fn = rollout_fn
        self.scenarios = scenarios
        # Each train call returns once the replicas serve the new step (~0.08 s after publishing it), and
        # only then do rollouts on it start: when they started at the publish, the replicas still served
        # the step before, and such groups were trained two steps off-policy, or dropped as stale (1-4 of
        # 4 a step in bench/end_to_end.py).
        self.train_config = train_config or TrainConfig()
        self.num_rollout_workers = num_rollout_workers
        self.min_batch_size = min_batch_size
        self.max_batch_size = max(max_batch_size or min_batch_size, min_batch_size)
        self.max_steps_off_policy = max_steps_off_policy
        self.max_steps = max_steps
        self.eval_fn = eval_fn
        self.eval_every_n_steps = eval_every_n_steps
        self.resume = resume
        self.state_path = state_path
        self.verbose = verbose
        self.reports: list[StepReport] = []
        self.state = PipelineState()
        # Groups finished and not yet taken by the trainer; the admission gate bounds it.
        self._queue: asyncio.Queue[TrajectoryGroup] = asyncio.Queue()
        self._engine = _BusyClock()
        # Admission: groups started and neither trained nor dropped yet (a batch being collected still
        # counts), and whether a train call runs; both change under this condition, with the policy step.
        self._gate = asyncio.Condition()
        self._outstanding = 0
        self._training = False
        self._exhausted = False
        self._taken = 0
        self._scenario_lock = asyncio.Lock()
        self._stop = False
        self._start_step = 0

    # --- public ---------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop after the step being trained, or now if none is (rollouts in flight are cancelled; the state
        saved after the last step keeps their scenarios for a resumed run)."""
        self._stop = True

    async def train(self) -> list[StepReport]:
        """Run until `max_steps` steps were trained or the scenarios run out; returns the step reports."""
        self.state_path = self.state_path or self._default_state_path()
        step = await self.model.get_step()
        self.state = self._load_state(step)
        self._start_step = self.state.step = step
        self._taken = self.state.scenario_offset
        scenarios = self._scenario_stream(self.state.scenario_offset)
        workers = [
            asyncio.ensure_future(self._rollout_worker(scenarios)) for _ in range(self.num_rollout_workers)
        ]
        try:
            await self._training_stage()
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return self.reports

    # --- rollouts -------------------------------------------------------------------------------

    async def _scenario_stream(self, skip: int) -> AsyncIterator[Any]:
        if isinstance(self.scenarios, AsyncIterator) or hasattr(self.scenarios, "__aiter__"):
            index = 0
            async for scenario in self.scenarios:  # type: ignore[union-attr]
                if index >= skip:
                    yield scenario
                index += 1
            return
        iterator: Iterator[Any] = iter(self.scenarios)  # type: ignore[arg-type]
        for _ in range(skip):
            if next(iterator, _END) is _END:
                return
        for scenario in iterator:
            yield scenario

    async def _next_scenario(self, scenarios: AsyncIterator[Any]) -> tuple[bool, Any]:
        async with self._scenario_lock:  # one reader at a time: an async generator is not reentrant
            if self._exhausted:
                return False, None
            try:
                scenario = await anext(scenarios)
            except StopAsyncIteration:
                self._exhausted = True
                return False, None
            self._taken += 1
            return True, scenario

    def _may_start_rollout(self) -> bool:
        """A group started now samples from policy `step`, so it may train in the batches based on policies
        `step` .. `step + max_steps_off_policy`; the first of them is `step + 1` while a train call runs.
        Start it only while the groups outstanding fit in those batches: no group is sampled only to be
        dropped as stale (unless its rollout outlasts the bound), and with a bound of 0 the loop is the
        sync loop. ART's PipelineTrainer lets workers sample whenever the queue has room, and groups
        sampled then were dropped stale or trained a step older than needed (bench/end_to_end.py)."""
        if self._stop:
            return False
        step = self.state.step
        first_base = step + 1 if self._training else step
        last_base = step + self.max_steps_off_policy
        if self.max_steps is not None:  # no batch past the run's last step
            last_base = min(last_base, self._start_step + self.max_steps - 1)
        return self._outstanding < (last_base - first_base + 1) * self.max_batch_size

    async def _admit(self) -> None:
        async with self._gate:
            await self._gate.wait_for(self._may_start_rollout)
            self._outstanding += 1

    async def _release(self) -> None:
        async with self._gate:
            self._outstanding -= 1
            self._gate.notify_all()

    async def _set_policy(self, *, training: bool, step: int | None = None, batch: int = 0) -> None:
        async with self._gate:
            self._training = training
            self._outstanding -= batch
            if step is not None:
                self.state.step = step
            self._gate.notify_all()

    async def _rollout_worker(self, scenarios: AsyncIterator[Any]) -> None:
        while True:
            await self._admit()
            found, scenario = await self._next_scenario(scenarios)
            if not found:
                await self._release()
                return
            initial = self.state.step
            self._engine.enter()
            try:
                group = self.rollout_fn(self.model, scenario)
                group = await group if inspect.isawaitable(group) else group
            except Exception as error:  # a rollout function that raised: counted, the loop goes on
                print(f"art-ray pipeline: a rollout failed: {type(error).__name__}: {error}", file=sys.stderr)
                self.state.groups_failed += 1
                await self._release()
                continue
            finally:
                self._engine.leave()
            if not isinstance(group, TrajectoryGroup):
                raise TypeError(f"rollout_fn returned {type(group).__name__}, expected a TrajectoryGroup")
            for trajectory in group.trajectories:
                trajectory.stamp_policy_versions(initial, self.state.step)
            await self._queue.put(group)

    # --- training -------------------------------------------------------------------------------

    async def _training_stage(self) -> None:
        last = time.perf_counter()
        engine_last = self._engine.read()
        while not self._stop and (
            self.max_steps is None or self.state.step - self._start_step < self.max_steps
        ):
            batch, stale, depth = await self._collect_batch()
            if not batch or self._stop:
                return  # the scenarios ran out, or a stop came while collecting: resume samples them again
            policy = self.state.step
            ages = [policy - (t.initial_policy_version or 0) for g in batch for t in g.trajectories]
            started = time.perf_counter()
            await self._set_policy(training=True, batch=len(batch))
            try:
                new_step = await self.model.train(batch, self.train_config, verbose=False)
            except BaseException:
                await self._set_policy(training=False)
                raise
            # the new policy and the end of training at once: no rollout starts in between on the old one
            await self._set_policy(training=False, step=new_step)
            now = time.perf_counter()
            engine_now = self._engine.read()
            report = StepReport(
                step=new_step,
                groups=len(batch),
                trajectories=sum(len(g) for g in batch),
                reward=statistics.fmean(t.reward for g in batch for t in g.trajectories),
                steps_off_policy_mean=statistics.fmean(ages) if ages else 0.0,
                steps_off_policy_max=max(ages, default=0),
                groups_dropped_stale=stale,
                queue_depth=depth,
                engine_busy=min(1.0, (engine_now - engine_last) / max(now - last, 1e-9)),
                trainer_busy=(now - started) / max(now - last, 1e-9),
                seconds=now - last,
            )
            last, engine_last = now, engine_now
            self.state.groups_trained += len(batch)
            self.state.scenario_offset = self._taken
            self.reports.append(report)
            await self.model.log([], split="pipeline", metrics=report.metrics())
            self._save_state()
            if self.verbose:
                self._print_row(report)
            await self._maybe_eval(new_step)

    async def _collect_batch(self) -> tuple[list[TrajectoryGroup], int, int]:
        """Wait for `min_batch_size` usable groups, then take what else is queued, up to the maximum.
        Returns the batch, the stale groups dropped meanwhile, and the queue depth found."""
        batch: list[TrajectoryGroup] = []
        stale = 0
        depth = self._queue.qsize()
        while len(batch) < self.max_batch_size and not self._stop:
            if len(batch) >= self.min_batch_size and self._queue.empty():
                break
            if self._exhausted and self._queue.empty() and self._engine.active == 0:
                break
            try:
                group = await asyncio.wait_for(self._queue.get(), timeout=0.5)
            except TimeoutError:
                continue
            verdict = self._verdict(group)
            if verdict != "trainable":
                await self._release()  # its place goes to a rollout on the current policy
            if verdict == "stale":
                stale += 1
                self.state.groups_stale += 1
            elif verdict == "no_signal":
                self.state.groups_without_signal += 1
            elif verdict == "failed":
                self.state.groups_failed += 1
            else:
                batch.append(group)
        return batch, stale, depth

    def _verdict(self, group: TrajectoryGroup) -> str:
        if not group.trajectories:
            return "failed"
        versions = [
            t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None
        ]
        if versions and self.state.step - min(versions) > self.max_steps_off_policy:
            return "stale"
        if not group.has_signal:
            return "no_signal"
        return "trainable"

    async def _maybe_eval(self, step: int) -> None:
        if self.eval_fn is None:
            return
        last = self.state.last_eval_step
        if last is not None and step - last < self.eval_every_n_steps:
            return
        groups = await self.eval_fn(self.model, step)
        await self.model.log(groups, split="val")
        self.state.last_eval_step = step
        self._save_state()

    # --- state ----------------------------------------------------------------------------------

    def _default_state_path(self) -> str:
        backend = self.model.backend
        if getattr(backend, "storage", None) is not None:  # a RayBackend: beside the checkpoints
            return f"{backend.model_dir(self.model)}/{STATE_FILE}"
        return os.path.join(".art_ray", self.model.project, self.model.name, STATE_FILE)

    def _load_state(self, step: int) -> PipelineState:
        from art_ray import storage

        assert self.state_path is not None
        if not self.resume or not storage.exists(self.state_path):
            return PipelineState(step=step)
        state = PipelineState.model_validate_json(storage.read_text(self.state_path))
        if state.step != step:
            print(
                f"art-ray pipeline: the saved state is at step {state.step} but the model resumed at step "
                f"{step} (its newest complete checkpoint); continuing from step {step} and scenario "
                f"{state.scenario_offset}",
                file=sys.stderr,
            )
        return state

    def _save_state(self) -> None:
        from art_ray import storage

        assert self.state_path is not None
        if "://" not in self.state_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.state_path)), exist_ok=True)
        storage.write_text(self.state_path, self.state.model_dump_json())

    def _print_row(self, report: StepReport) -> None:
        if len(self.reports) == 1:
            print(
                "step  groups  reward  off-policy mean/max  stale  queue  engine busy  trainer busy  seconds",
                flush=True,
            )
        print(
            f"{report.step:>4}  {report.groups:>6}  {report.reward:>6.3f}  "
            f"{report.steps_off_policy_mean:>10.2f} / {report.steps_off_policy_max:<6}  "
            f"{report.groups_dropped_stale:>5}  {report.queue_depth:>5}  {report.engine_busy:>11.2f}  "
            f"{report.trainer_busy:>12.2f}  {report.seconds:>7.1f}",
            flush=True,
        )


_END = object()
