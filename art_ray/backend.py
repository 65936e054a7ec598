"""RayBackend: runs the inference app and a trainer group per registered model on a Ray cluster.

With no address it starts an embedded local Ray (CPU defaults); with "auto", "ray://..." or inside a
`ray job submit` job it connects to that cluster. It tears down what it started.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from art_ray import keys
from art_ray.access import KEY_PREFIX, AccessTable, KeyGrant
from art_ray.adapters.registry import get_registry
from art_ray.errors import BackendError
from art_ray.models import default_tool_call_parser, resolve_base_model
from art_ray.placement import ModelPlan, PlacementError, cluster_shapes, plan_model, wait_placeable
from art_ray.role_configs import kv_cache_tokens, serving_config, trainer_config
from art_ray.serving.config import ServingConfig
from art_ray.startup import side_by_side
from art_ray.tinker.types import AdamStep, ForwardBackwardCall, ForwardBackwardResult
from art_ray.tracking import Tracker, group_metrics, save_trajectories
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.train_result import GradientStep, TrainEvent, TrainResult
from art_ray.trainer.config import TrainerConfig
from art_ray.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_ray.model import TrainableModel
    from art_ray.releases import ReleaseAction, ReleaseState
    from art_ray.traffic.records import MaturedTraffic, TrafficCursor, TrafficSnapshot
    from art_ray.trainer.group import TrainerGroup

logger = logging.getLogger(__name__)
Result = TypeVar("Result")


def _driver_code_path() -> str:
    """The driver's own code folders (not the interpreter's or installed packages'), for the workers of
    an embedded cluster: a remote rollout defined in a module the driver imported from anywhere must
    import on the workers too. (On a real cluster, a job's working_dir does this.)"""
    import site
    import sysconfig

    installed = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    installed.update(site.getsitepackages())
    folders = []
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        if os.path.isdir(folder) and not folder.startswith(tuple(installed)):
            folders.append(folder)
    existing = os.environ.get("PYTHONPATH")
    return os.pathsep.join(dict.fromkeys([*folders, *([existing] if existing else [])]))


def _drop_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def rank_died(error: ray.exceptions.RayActorError) -> bool:
    """Whether a trainer call failed because one of its ranks is gone. A live rank's task that raised
    is a RayTaskError, and one whose cause was another actor's death (a replica dying while the step was
    published) is by its class a RayActorError too: that is the call's error, not a reason to restart
    the ranks and train the call again."""
    return not isinstance(error, ray.exceptions.RayTaskError)


class RayBackend:
    """Serves and trains TrainableModels on a Ray cluster.

    `address`: None starts an embedded local Ray (or joins the job's cluster under `ray job submit`);
    "auto" or "ray://host:10001" connects to a running cluster. `storage`: checkpoints, trajectories and
    (by default) the MLflow store; a local folder or any pyarrow.fs URI. `host`/`port`: where Serve's
    proxy listens if this backend starts Serve; `port=None` takes 8000 if no process listens there, else
    a free port (and says which), while a `port` asked for that another process listens on raises
    PortInUseError at register (Serve would share it: art_ray/serve_port.py). `app_name`/`route_prefix`:
    the Serve app, so several backends can share one Serve instance. `api_key`: required as Bearer token
    on the endpoint.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        storage: str = "./art_ray_runs",
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
        app_name: str = "art",
        route_prefix: str = "/",
        num_cpus: int | None = None,
        tracking_uri: str | None = None,
    ) -> None:
        self.address = address
        self.storage = storage
        self.host, self.port = host, port
        self.api_key = api_key
        self.app_name = app_name
        self.route_prefix = route_prefix
        self.num_cpus = num_cpus
        # MLflow: a local SQLite store beside the checkpoints unless a tracking server is named
        if tracking_uri is None and "://" not in storage:
            folder = os.path.abspath(os.path.expanduser(storage))
            os.makedirs(folder, exist_ok=True)
            tracking_uri = f"sqlite:///{folder}/mlflow.db"
        self.tracking_uri = tracking_uri
        self.base_url: str | None = None
        # the inference app's identity (art_ray/deployment.py), known once it is started
        self.deployment: str | None = None
        self._base_model: str | None = None
        self._max_lora_rank = 0
        self._layout: str | None = None
        self._trainers: dict[str, TrainerGroup] = {}
        # per model, the last call that made a step (a train call, or a Tinker optim_step with the
        # forward_backward calls it applied): its checkpoint is written in the background, and if a rank
        # dies before it is complete the restarted group makes the step again (same data, same step)
        self._last_call: dict[str, Callable[[TrainerGroup], Awaitable[None]]] = {}
        # per model, the train call in flight: the step it started from and how to make its step again. A
        # rank that dies after the call made its step (while publishing or checkpointing it) leaves the step
        # to this call, not to the last one (found by the soak: the previous call's groups trained twice)
        self._making: dict[str, tuple[int, Callable[[TrainerGroup], Awaitable[None]]]] = {}
        # per Tinker run, its forward_backward calls since its last optim_step: their gradients live on
        # the ranks until then, so a restarted group is sent them again
        self._tinker_pending: dict[str, list[ForwardBackwardCall]] = collections.defaultdict(list)
        self._trackers: dict[str, Tracker] = {}
        self._restarting = asyncio.Lock()
        self._started_ray = False
        # idle time-to-live (ModelConfig.idle_ttl_s): when each run was last called, its calls in flight
        self._last_used: dict[str, float] = {}
        self._in_call: collections.Counter[str] = collections.Counter()
        self._reaper: asyncio.Task[None] | None = None
        # per run with a release, the rolled-back steps its trainer has moved off (see `release`)
        self._rolled_back: dict[str, set[int]] = {}

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        if self.address is None and "RAY_ADDRESS" not in os.environ:
            # an embedded cluster of our own, never another process's (a bare ray.init() would join it);
            # Ray turns token authentication on for it, as for every new local cluster, and its notice that
            # it did (with how to opt out) is not news to a script that never chose a mode
            auth_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
            auth_logger.addFilter(_drop_token_auth_notice)
            try:
                self._init_embedded_ray()
            finally:
                auth_logger.removeFilter(_drop_token_auth_notice)
            self._started_ray = True
        else:
            ray.init(address=self.address or os.environ["RAY_ADDRESS"], log_to_driver=False)

    def _init_embedded_ray(self) -> None:
        from art_ray.serving.launch import embedded_ray

        with embedded_ray():
            ray.init(
                address="local",
                num_cpus=self.num_cpus or max(2, os.cpu_count() or 2),
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": _driver_code_path()}},
            )

    def start_serve(self) -> tuple[str, int]:
        """Start Serve on the cluster (the first register does), or join the Serve running there; returns
        the host and port its proxy listens on. PortInUseError when `port` was asked for and another
        process listens there; with `port=None` a held 8000 gives way to a free port, said in a line."""
        from art_ray.serve_deploy import start_serve

        self._connect()
        return start_serve(self.host, self.port, "RayBackend(port=...)")

    def _serving_config(self, model: TrainableModel, base_model: str, plan: ModelPlan) -> ServingConfig:
        return serving_config(
            model.config,
            plan,
            base_model=base_model,
            app_name=self.app_name,
            route_prefix=self.route_prefix,
            api_key=self.api_key,
            tool_call_parser=default_tool_call_parser(model.base_model),
        )

    def _trainer_config(self, model: TrainableModel, base_model: str, plan: ModelPlan) -> TrainerConfig:
        return trainer_config(
            model.config,
            plan,
            name=model.name,
            project=model.project,
            base_model=base_model,
            storage=self.storage,
        )

    async def _gpu_memory_plan(self, model: TrainableModel, base_model: str, plan: ModelPlan) -> str:
        """The memory plan against the GPU of a node the trainer would run on (its size is only known
        there); raises MemoryPlanError naming the setting to change before anything is started."""
        from art_ray.memory_plan import check_on_this_gpu

        pinned = {key: 0.001 for key in plan.trainer_rank.resources}
        task = ray.remote(check_on_this_gpu).options(num_cpus=0, num_gpus=0.01, resources=pinned)
        ref = task.remote(model.config, base_model, plan.layout)
        try:
            return await asyncio.wait_for(ref, model.config.placement_timeout_s)
        except TimeoutError:
            ray.cancel(ref)
            raise PlacementError(
                f"no GPU node took the memory check of {model.name!r} within "
                f"{model.config.placement_timeout_s:.0f} s (ModelConfig.placement_timeout_s)"
            ) from None

    @staticmethod
    def _cpu_memory_plan(model: TrainableModel, base_model: str, plan: ModelPlan) -> list[str]:
        """The tensors of the roles that run on CPU, from the model's config.json where this process can
        read it (a local model; a hub id or a path only the cluster's nodes hold is not planned here)."""
        from art_ray.memory_plan import ModelShape, plan_cpu_memory

        if "cpu" not in (plan.engine_device, plan.trainer_device):
            return []
        try:
            shape = ModelShape.from_model_dir(base_model)
        except (OSError, KeyError, ValueError):
            return []
        cpu = plan_cpu_memory(model.config, shape, kv_cache_tokens(model.config))
        lines = ["memory plan on CPU (tensors; each process also holds its runtime: Python, torch, vLLM)"]
        if plan.engine_device == "cpu":
            lines.append(f"  {cpu.engine_line()}")
        if plan.trainer_device == "cpu":
            lines.append(f"  {cpu.trainer_line()}")
        return lines

    async def register(self, model: TrainableModel) -> None:
        """Serve the model's base model (once) and start its trainer group; returns when `name` serves
        the latest step (resumed from the latest checkpoint if there is one). Raises PlacementError
        (naming the setting to change) when the cluster cannot hold the model's layout."""
        from art_ray.deployment import deployment_identity
        from art_ray.serving.launch import start_inference
        from art_ray.trainer.group import TrainerGroup

        started = time.monotonic()
        self._connect()
        if self._base_model is None:
            # before anything slow: a port another process holds fails at once (or gives way to a free
            # one), and the proxy holds this one from now on
            await asyncio.to_thread(self.start_serve)
        base_model = resolve_base_model(model.base_model)
        running = self._trainers.get(model.name)
        if running is not None and (running.config.settings, running.config.base_model) != (
            model.config,
            base_model,
        ):
            raise BackendError(
                f"a model named {model.name!r} is already registered on this backend with another base model "
                "or ModelConfig: give this one another name"
            )
        plan = plan_model(model.config, cluster_shapes())
        if "gpu" in (plan.engine_device, plan.trainer_device):
            print(await self._gpu_memory_plan(model, base_model, plan), flush=True)
        shared = None
        if model.name not in self._trainers and model.config.share_trainer:
            wanted = self._trainer_config(model, base_model, plan)
            shared = next((t.ranks for t in self._trainers.values() if t.ranks.accepts(wanted)), None)
        # Everything this call will start must fit before any of it starts.
        demands = (
            []
            if model.name in self._trainers or shared is not None
            else [plan.trainer_rank.demand()] * model.config.world_size
        )
        if self._base_model is None:
            demands += [plan.replica.demand()] * model.config.replicas_at_start
        await wait_placeable(
            demands,
            f"model {model.name!r} ({plan.layout})",
            "ModelConfig.replica_cpus / replica_gpus / num_replicas / replica_resources or "
            "trainer_cpus_per_rank / trainer_gpus_per_rank / world_size / trainer_resources",
            model.config.placement_timeout_s,
        )
        if shared is None:  # a run that joins a trainer starts nothing the plan would describe
            print(f"art-ray: {model.name}: {plan.describe()}", flush=True)
            for line in self._cpu_memory_plan(model, base_model, plan):
                print(f"art-ray: {model.name}: {line}", flush=True)
        parts: dict[str, Awaitable[Any]] = {}
        if self._base_model is None:
            config = self._serving_config(model, base_model, plan)
            # in a thread: deploying waits for the engines, and a training server's event loop keeps
            # answering meanwhile
            deployment = deployment_identity(self.app_name)
            parts["inference app"] = asyncio.to_thread(
                start_inference, config, self.host, self.port, deployment=deployment
            )
        elif base_model != self._base_model:
            raise BackendError(
                f"this backend serves {self._base_model}; models on another base model need a backend of "
                "their own (another app_name and port)"
            )
        elif model.config.lora.r > self._max_lora_rank:
            raise BackendError(
                f"model {model.name!r} has LoRA rank {model.config.lora.r} but this backend's engines load "
                f"adapters up to rank {self._max_lora_rank} (set by the first model registered)"
            )
        elif plan.layout != self._layout:
            raise BackendError(
                f"model {model.name!r} plans layout {plan.layout!r} but this backend's engines run "
                f"{self._layout!r} (set by the first model registered): set ModelConfig.layout"
            )
        trainer = None
        if model.name not in self._trainers:
            trainer = TrainerGroup(
                self._trainer_config(model, base_model, plan),
                placement_timeout_s=model.config.placement_timeout_s,
                ranks=shared,
            )
            label = "trainer" if shared is None else f"run on the trainer of {shared.founder.model}"
            parts[label] = trainer.prepare()
        if model.name not in self._trackers:
            tracking_uri = model.tracking_uri or self.tracking_uri
            parts["MLflow"] = asyncio.to_thread(Tracker, model.project, model.name, tracking_uri)
        results = await side_by_side(parts, lambda line: print(f"art-ray: {model.name}: {line}", flush=True))
        if isinstance(url := results.get("inference app"), str):
            self.base_url = url
            self.deployment = deployment
            self._base_model = base_model
            self._max_lora_rank = config.engine.max_lora_rank
            self._layout = plan.layout
        if isinstance(tracker := results.get("MLflow"), Tracker):
            self._trackers[model.name] = tracker
        failed = [result for result in results.values() if isinstance(result, BaseException)]
        if trainer is not None and not failed:
            try:
                await get_registry().set_owner.remote(model.name, model.config.owner)  # before it is served
                await trainer.publish_current()  # served before register returns
            except BaseException as error:
                failed.append(error)
        if failed:
            if trainer is not None:
                await trainer.leave()
            raise failed[0]
        if trainer is not None:
            self._trainers[model.name] = trainer
        await self._store_traffic(model)
        if model.config.release is not None:
            from art_ray.release_control import begin

            trainer = self._trainers[model.name]
            if trainer.step not in self.checkpoint_steps(model):  # a rollback to it trains on from its state
                await trainer.save_state(trainer.config.checkpoint_dir(trainer.step))
            release = await begin(model.name, trainer.step, model.config.release)
            self._rolled_back[model.name] = set(release.rejected)
        self._touch(model.name)
        if model.config.idle_ttl_s is not None and (self._reaper is None or self._reaper.done()):
            self._reaper = asyncio.get_running_loop().create_task(self._reap_idle_runs())
        print(
            f"art-ray: {model.name}: registered in {time.monotonic() - started:.0f} s, serving step "
            f"{self._trainers[model.name].step} at {self.base_url}",
            flush=True,
        )

    def _trainer(self, model: TrainableModel) -> TrainerGroup:
        if model.name not in self._trainers:
            raise BackendError(f"model {model.name!r} is not registered: await model.register(backend) first")
        self._touch(model.name)
        return self._trainers[model.name]

    def is_registered(self, name: str) -> bool:
        """Whether a run of this name trains here (not deleted, nor expired by its idle_ttl_s)."""
        return name in self._trainers

    def _touch(self, name: str) -> None:
        self._last_used[name] = time.monotonic()

    async def _reap_idle_runs(self) -> None:
        """Delete the runs idle past their ModelConfig.idle_ttl_s (none with a call in flight); ends when
        no registered run has a time-to-live."""
        while True:
            ttls = {
                name: ttl
                for name, trainer in self._trainers.items()
                if (ttl := trainer.config.settings.idle_ttl_s) is not None
            }
            if not ttls:
                return
            now = time.monotonic()
            for name, ttl in ttls.items():
                if self._in_call[name] or now - self._last_used.get(name, now) <= ttl:
                    continue
                print(
                    f"art-ray: {name}: idle for {ttl:g} s: deleted (its checkpoints stay; registering it "
                    "again resumes it)",
                    flush=True,
                )
                try:
                    await self._delete_run(name, purge_checkpoints=False)
                except Exception as error:  # noqa: BLE001 - the other runs' time-to-live still holds
                    logger.warning("deleting the idle run %s failed: %s", name, error)
            await asyncio.sleep(min(max(min(ttls.values()) / 4, 0.25), 30.0))

    def tracker(self, model: TrainableModel) -> Tracker:
        """The model's MLflow run (experiment = project, run = model name)."""
        self._trainer(model)  # raises if not registered
        return self._trackers[model.name]

    async def train(
        self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> AsyncIterator[TrainEvent]:
        """Train one step: the groups' reward metrics and Parquet go under the current step, each
        gradient step is yielded as it finishes, then the TrainResult (its metrics logged to MLflow at the
        new step)."""
        trainer, tracker = self._trainer(model), self.tracker(model)
        step = trainer.step
        async for event in self._train_call(
            model, lambda trainer, max_tokens: trainer.train(groups, config, max_tokens)
        ):
            yield event
        # after the step, so that a retried or failed call logs nothing twice
        tracker.log_metrics(group_metrics(groups, "train"), step)
        save_trajectories(trainer.config.model_dir(), "train", step, groups)

    async def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> AsyncIterator[TrainEvent]:
        """One supervised step (cross-entropy on the assistant turns), streamed as `train` is."""
        async for event in self._train_call(
            model, lambda trainer, max_tokens: trainer.train_sft(trajectories, config, max_tokens)
        ):
            yield event

    async def _train_call(
        self,
        model: TrainableModel,
        call: Callable[[TrainerGroup, int | None], AsyncIterator[TrainEvent]],
    ) -> AsyncIterator[TrainEvent]:
        """`call(trainer, max_tokens)` under the owner key's token limit, retried as `_retried` does and
        counted as in flight meanwhile (an idle time-to-live never expires a run mid-call)."""
        with self._counted_in_flight(model):
            max_tokens = await self._max_train_tokens(model)
            async for event in self._retried(model, lambda trainer: call(trainer, max_tokens)):
                yield event

    # --- the Tinker API's verbs (art_ray/tinker/): gradients add up until optim_step ----------------

    async def forward_backward(
        self, model: TrainableModel, call: ForwardBackwardCall
    ) -> ForwardBackwardResult:
        """Per-datum logprobs and loss terms under the run's current adapter; the call's gradients (its
        losses summed) are applied by the run's next `optim_step`. TinkerUserError for a malformed call."""
        result = await self._in_flight(
            model, self._tinker_retried(model, lambda trainer: trainer.tinker_forward_backward(call))
        )
        if not call.forward_only:
            self._tinker_pending[model.name].append(call)
        return result

    async def optim_step(self, model: TrainableModel, step: AdamStep) -> dict[str, float]:
        """One AdamW step on the gradients of the run's forward_backward calls since its last step; the
        run's step advances (checkpointed in the background, as a train call's). Nothing is published:
        `save_for_sampler` does that."""
        applied = list(self._tinker_pending.get(model.name, []))
        made_again: list[dict[str, float]] = []

        async def again(trainer: TrainerGroup) -> None:
            for call in applied:
                await trainer.tinker_forward_backward(call)
            made_again.append(await trainer.tinker_optim_step(step))

        started_at = self._trainer(model).step

        async def once(trainer: TrainerGroup) -> dict[str, float]:
            if trainer.step > started_at:  # a restart made it again from its calls
                return made_again[-1] if made_again else {}
            return await trainer.tinker_optim_step(step)

        self._making[model.name] = (started_at, again)
        try:
            metrics = await self._in_flight(model, self._tinker_retried(model, once))
        finally:
            self._making.pop(model.name, None)
        self._tinker_pending.pop(model.name, None)
        self._last_call[model.name] = again
        # A Tinker run's step checkpoints are art-ray's own, for a restart (its user keeps states with
        # save_state): the last complete one and this step's, still being written, are all a restart
        # needs, and one per step would fill the storage in a long run. The newest complete one stays
        # whatever storage shows of the previous step's, so a restart always has one to resume from.
        current = self._trainer(model).step
        complete = self.checkpoint_steps(model)
        self._delete_checkpoints_of(model, complete, keep={current - 1, current, *complete[-1:]})
        return metrics

    async def save_for_sampler(self, model: TrainableModel) -> int:
        """Publish the run's current adapter as `name@step` (served by every replica when this returns,
        and never changed after); the step."""
        await self._in_flight(model, self._tinker_retried(model, lambda trainer: trainer.publish_current()))
        return self._trainer(model).step

    async def save_state(self, model: TrainableModel, folder: str) -> None:
        """The run's training state (adapter, optimizer, step) into `folder`, complete when this returns."""
        await self._in_flight(model, self._tinker_retried(model, lambda trainer: trainer.save_state(folder)))

    async def load_state(self, model: TrainableModel, folder: str, optimizer: bool = True) -> int:
        """A state `save_state` wrote into the run (its optimizer state too if `optimizer`); the step. The
        new adapter is served from the next `save_for_sampler` on."""
        return await self._in_flight(
            model, self._tinker_retried(model, lambda trainer: trainer.load_state(folder, optimizer))
        )

    async def _tinker_retried(
        self, model: TrainableModel, call: Callable[[TrainerGroup], Awaitable[Result]]
    ) -> Result:
        """A Tinker verb; when a trainer rank died, the group is restarted (the run's steps and waiting
        gradients with it, see `_restart_trainer`) and the verb runs once more."""
        trainer = self._trainer(model)
        try:
            return await call(trainer)
        except ray.exceptions.RayActorError as died:
            if not rank_died(died):
                raise
            await self._restart_dead(model, trainer, died)
        return await call(self._trainer(model))

    async def _in_flight(self, model: TrainableModel, call: Awaitable[Result]) -> Result:
        with self._counted_in_flight(model):
            return await call

    @contextlib.contextmanager
    def _counted_in_flight(self, model: TrainableModel) -> Iterator[None]:
        """The body counts as the run's call in flight (an idle time-to-live never expires a run mid-call,
        and delete_run waits for it); the run was used when it ends."""
        self._in_call[model.name] += 1
        try:
            yield
        finally:
            self._in_call[model.name] -= 1
            self._touch(model.name)

    async def _max_train_tokens(self, model: TrainableModel) -> int | None:
        """The tokens one train call of `model` may pack: its owner key's limit (None: no limit)."""
        if model.config.owner is None:
            return None
        grant = (await get_registry().access.remote()).grant_named(model.config.owner)
        return grant.max_train_tokens if grant is not None else None

    async def create_key(self, grant: KeyGrant, key: str | None = None, prefix: str = KEY_PREFIX) -> str:
        """A run key (art_ray/keys.py): it sees the runs whose `ModelConfig.owner` is `grant.name`, and
        nothing else, within the grant's limits; returns the key (drawn unless given)."""
        self._connect()
        return await keys.create_key(grant, key, prefix)

    async def revoke_key(self, name: str) -> None:
        self._connect()
        await keys.revoke_key(name)

    async def access(self) -> AccessTable:
        """The cluster's run keys (names and limits; no key is kept) and run owners."""
        self._connect()
        return await keys.access_table()

    async def _retried(
        self, model: TrainableModel, call: Callable[[TrainerGroup], AsyncIterator[TrainEvent]]
    ) -> AsyncIterator[TrainEvent]:
        """Run a train call; when a trainer rank died, restart the group from its last complete
        checkpoint and run the call once more (its gradient steps stream again), unless the call had made
        its step before the rank died (publishing or checkpointing it): then the restart holds that step,
        from its checkpoint or made again from this call, and the call returns it. Only the result's
        metrics are logged, once."""

        async def again(trainer: TrainerGroup) -> None:
            async for _ in call(trainer):
                pass

        trainer = self._trainer(model)
        started_at = trainer.step
        gradient_steps: list[GradientStep] = []
        self._making[model.name] = (started_at, again)
        try:
            try:
                async for event in self._logged(model, call(trainer)):
                    if isinstance(event, GradientStep):
                        gradient_steps.append(event)
                    yield event
                self._last_call[model.name] = again
                return
            except ray.exceptions.RayActorError as died:
                if not rank_died(died):
                    raise
                await self._restart_dead(model, trainer, died)
            restarted = self._trainer(model)
            if restarted.step > started_at:
                # the call had made its step: the new ranks hold it (from its checkpoint, or made again
                # from this call by the restart), so it is not trained a second time
                result = TrainResult.of(
                    restarted.step, gradient_steps, {}, restarted.config.checkpoint_dir(restarted.step)
                )
                self.tracker(model).log_metrics(result.metrics, result.step)
                yield result
            else:
                async for event in self._logged(model, call(restarted)):
                    yield event
            self._last_call[model.name] = again
        finally:
            self._making.pop(model.name, None)

    async def _restart_dead(
        self, model: TrainableModel, trainer: TrainerGroup, died: ray.exceptions.RayActorError
    ) -> None:
        """Restart the model's group after `trainer` met a dead rank, unless another call (runs sharing
        the ranks all meet the dead rank) restarted it already."""
        async with self._restarting:
            if self._trainers.get(model.name) is trainer:
                reason = type(died).__name__
                print(f"art-ray: {model.name}: a trainer rank died ({reason}); restarting it", flush=True)
                await self._restart_trainer(model)

    async def _restart_trainer(self, model: TrainableModel) -> None:
        """New ranks from the latest complete checkpoint, for the model and every run that shared its
        ranks. The steps no complete checkpoint holds are made again from the calls that made them (the
        last call that returned, the call in flight: `_steps_to_make_again`), so none is lost (metrics
        logged once, when the call returned); then a Tinker run's forward_backward calls since its last
        optim_step, so their gradients wait on the new ranks as on the old."""
        from art_ray.trainer.group import TrainerGroup

        dead = self._trainers[model.name]
        runs = [
            model.name,
            *(n for n, t in self._trainers.items() if t.ranks is dead.ranks and n != model.name),
        ]
        dead.kill()
        ranks = None
        for name in runs:
            old = self._trainers.pop(name)
            trainer = TrainerGroup(
                old.config, placement_timeout_s=old.config.settings.placement_timeout_s, ranks=ranks
            )
            await trainer.start()  # resumes from the latest complete checkpoint and publishes it
            ranks = trainer.ranks
            self._trainers[name] = trainer
            remakes = self._steps_to_make_again(name, restored=trainer.step, reached=old.step)
            for step, remake in enumerate(remakes, start=trainer.step + 1):
                print(f"art-ray: {name}: step {step} was not on storage; training it again")
                await remake(trainer)
            if remakes and self._made_in_flight(name, old.step):
                # the call in flight applied them as it was made again
                self._tinker_pending.pop(name, None)
            if trainer.step != old.step:
                # gradients of the lost steps' adapter mean nothing to the one it goes on from
                self._tinker_pending.pop(name, None)
                lost = f"{name}: the trainer lost steps {trainer.step + 1}..{old.step} with its rank"
                if name == model.name:
                    raise BackendError(f"{lost} (no complete checkpoint holds them)")
                print(f"art-ray: {lost}; it goes on from step {trainer.step}", flush=True)
            for call in self._tinker_pending.get(name, []):
                await trainer.tinker_forward_backward(call)

    def _made_in_flight(self, name: str, reached: int) -> bool:
        """Whether the run's call in flight had made its step when its rank died."""
        making = self._making.get(name)
        return making is not None and reached == making[0] + 1

    def _steps_to_make_again(
        self, name: str, restored: int, reached: int
    ) -> list[Callable[[TrainerGroup], Awaitable[None]]]:
        """The calls that make the run's steps after `restored` (the latest complete checkpoint) up to
        `reached` (the step its ranks had made), oldest first; empty when one of them cannot be made again.
        A call's checkpoint is written while the next call trains and that call waits for it after making
        its own step: a rank lost then takes two steps, the last returned call's and the one in flight's."""
        last = self._last_call.get(name)
        if self._made_in_flight(name, reached):
            making = self._making[name]
            if restored == making[0]:
                return [making[1]]
            if restored == making[0] - 1 and last is not None:
                return [last, making[1]]
            return []
        return [last] if restored == reached - 1 and last is not None else []

    async def _logged(
        self, model: TrainableModel, events: AsyncIterator[TrainEvent]
    ) -> AsyncIterator[TrainEvent]:
        tracker = self.tracker(model)
        async for event in events:
            if isinstance(event, TrainResult):
                tracker.log_metrics(event.metrics, event.step)
            yield event

    async def log(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        split: str,
        metrics: dict[str, float] | None = None,
    ) -> dict[str, float]:
        trainer, tracker = self._trainer(model), self.tracker(model)
        logged = {**(group_metrics(groups, split) if groups else {}), **(metrics or {})}
        tracker.log_metrics(logged, trainer.step)
        if groups:
            save_trajectories(trainer.config.model_dir(), split, trainer.step, groups)
        return logged

    async def get_step(self, model: TrainableModel) -> int:
        return self._trainer(model).step

    def model_dir(self, model: TrainableModel) -> str:
        return self._trainer(model).config.model_dir()

    def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        from art_ray.trainer.group import checkpoint_steps

        return checkpoint_steps(self._trainer(model).config)

    async def delete_checkpoints(
        self,
        model: TrainableModel,
        best_checkpoint_metric: str = "val/reward",
        steps_to_keep: list[int] | None = None,
    ) -> list[int]:
        """Delete every checkpoint but `steps_to_keep`, or (without it) but the latest and the best by
        `best_checkpoint_metric` (higher is better); returns the deleted steps."""
        steps = self.checkpoint_steps(model)
        if not steps:
            return []
        if steps_to_keep is not None:
            keep = set(steps_to_keep)
        else:
            keep = {max(steps)}
            history = {
                step: value
                for step, value in self.tracker(model).history(best_checkpoint_metric).items()
                if step in steps
            }
            if history:
                keep.add(max(history, key=lambda step: history[step]))
        return self._delete_checkpoints_of(model, steps, keep)

    def _delete_checkpoints_of(self, model: TrainableModel, steps: list[int], keep: set[int]) -> list[int]:
        """Delete the checkpoints of `steps` but `keep`; the deleted steps."""
        from art_ray import storage

        deleted = [step for step in steps if step not in keep]
        for step in deleted:
            storage.delete_dir(self._trainer(model).config.checkpoint_dir(step))
        return deleted

    async def _store_traffic(self, model: TrainableModel) -> None:
        """Start the run's traffic log (ModelConfig.traffic), then have every replica store its turns in it;
        or have them store none."""
        from art_ray.traffic.log import ensure_traffic_log

        if model.config.traffic is not None:
            log = ensure_traffic_log(model.name, f"{self.model_dir(model)}/traffic", model.config.traffic)
            await log.folder.remote()  # its files read back before a replica stores a turn in it
        await get_registry().set_traffic.remote(model.name, model.config.traffic is not None)

    async def traffic(self, model: TrainableModel) -> TrafficSnapshot:
        """The run's stored turns and feedback (ModelConfig.traffic), oldest first."""
        from art_ray.traffic.log import get_traffic_log

        self._trainer(model)  # raises if not registered
        if model.config.traffic is None:
            raise BackendError(f"model {model.name!r} stores no traffic: set ModelConfig.traffic")
        return await get_traffic_log(model.name).snapshot.remote()

    async def matured_traffic(
        self, model: TrainableModel, after: TrafficCursor | None, limit: int
    ) -> MaturedTraffic:
        """The run's labeled turns past `after` (art_ray/traffic/matured.py)."""
        from art_ray.traffic.log import get_traffic_log

        self._trainer(model)  # raises if not registered
        if model.config.traffic is None:
            raise BackendError(f"model {model.name!r} stores no traffic: set ModelConfig.traffic")
        return await get_traffic_log(model.name).matured.remote(after, limit)

    async def release(self, model: TrainableModel, action: ReleaseAction) -> ReleaseState:
        """Read or move the run's release (art_ray/release_control.py). After a rollback, the run trains
        on from its stable step's weights and optimizer state, at its own step (published steps never
        repeat), and the steps trained on top of the rolled-back one are rolled back with it."""
        from art_ray.release_control import act, reject_descendants

        trainer = self._trainer(model)  # raises if not registered
        state = await act(model.name, action)
        handled = self._rolled_back.setdefault(model.name, set())
        if state.release is None or set(state.release.rejected) <= handled:
            return state
        # a rollback, by this call or elsewhere (the CLI, another driver) since this backend's last look
        first = min(set(state.release.rejected) - handled)
        handled.update(state.release.rejected)
        stable = state.release.stable
        if stable is None or stable not in self.checkpoint_steps(model):
            logger.warning(
                "%s: step %s has no checkpoint; training goes on from step %s's weights (the rollback "
                "holds for serving)",
                model.name,
                stable,
                first,
            )
            return state
        # waits for a train call in flight: a step trained on the rolled-back weights is published first
        step = await trainer.load_state(trainer.config.checkpoint_dir(stable), optimizer=True, keep_step=True)
        state = await reject_descendants(model.name, first, through=step, state=state)
        handled.update(state.release.rejected)
        return state

    async def delete_run(self, model: TrainableModel, purge_checkpoints: bool = False) -> None:
        """Stop training and serving a registered model, after its train call in flight if one is: its
        trainer state is freed once its last checkpoint is written (a shared trainer goes on with its other
        runs), every replica unloads its versions (its names then answer 404), its MLflow run ends. Its
        checkpoints stay, so registering the name again resumes it, unless `purge_checkpoints`."""
        self._trainer(model)  # raises if not registered
        while self._in_call[model.name]:  # a train call in flight finishes first (its step is kept)
            await asyncio.sleep(0.05)
        await self._delete_run(model.name, purge_checkpoints)

    async def _delete_run(self, name: str, purge_checkpoints: bool) -> None:
        from art_ray import storage

        trainer = self._trainers.pop(name)
        await asyncio.to_thread(trainer.shutdown)
        self._last_call.pop(name, None)
        self._tinker_pending.pop(name, None)
        self._last_used.pop(name, None)
        self._rolled_back.pop(name, None)
        tracker = self._trackers.pop(name, None)
        if tracker is not None:
            tracker.finish()
        await get_registry().retire.remote(name)
        await _stop_traffic_log(name)
        checkpoints = f"{trainer.config.model_dir()}/checkpoints"
        # its trajectories' Parquet files stay: the record of what it trained on; a run that never trained
        # has no checkpoints
        if purge_checkpoints and storage.exists(checkpoints):
            storage.delete_dir(checkpoints)

    def stop_trainers(self) -> None:
        for trainer in self._trainers.values():
            trainer.shutdown()
        for tracker in self._trackers.values():
            tracker.finish()
        self._trainers.clear()
        self._trackers.clear()

    def shutdown(self) -> None:
        """Stop the trainers and the app this backend started (and Ray, if it started it)."""
        from art_ray.serving.launch import stop_inference, stop_local_cluster

        self.stop_trainers()
        if self._started_ray and ray.is_initialized():
            stop_local_cluster()  # the whole embedded cluster goes, the app with it
            self._started_ray = False
        elif self._base_model is not None and ray.is_initialized():
            stop_inference(self.app_name)
        self._base_model = None


async def _stop_traffic_log(run: str) -> None:
    """A deleted run's traffic log writes what it holds to its files and stops (they stay on storage)."""
    from art_ray.traffic.log import get_traffic_log

    try:
        log = get_traffic_log(run)
    except ValueError:  # the run stored no traffic
        return
    await log.flush.remote()
    ray.kill(log, no_restart=True)
