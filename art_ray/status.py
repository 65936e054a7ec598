"""What runs on a cluster: the models the LoRA registry knows, what each inference replica serves, and the
trainers with the runs they hold."""

from __future__ import annotations

import pydantic
import ray

from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, get_registry
from art_ray.cluster_actors import NAMESPACE, get_cluster_actor
from art_ray.releases import Release, describe
from art_ray.tinker.config import TINKER_DEPLOYMENT
from art_ray.tinker.types import TinkerRunStatus
from art_ray.trainer.group import TRAINER_NAME_PREFIX
from art_ray.trainer.runs import RunStatus


class ModelStatus(pydantic.BaseModel):
    model: str
    base_model: str
    latest_step: int
    steps: list[int]
    # the name of the run key that owns it (None: the admin key only; art_ray/access.py)
    owner: str | None = None
    # its release (ModelConfig.release; art_ray/releases.py), None without one
    release: Release | None = None


class AppStatus(pydantic.BaseModel):
    app_name: str
    status: str
    replicas_running: int
    # per replica: model -> the steps it serves
    replicas: list[dict[str, list[int]]]


class TrainerStatus(pydantic.BaseModel):
    """A trainer group's ranks (rank 0's actor name) and the runs they hold."""

    name: str
    runs: list[RunStatus]


class ClusterStatus(pydantic.BaseModel):
    models: list[ModelStatus]
    apps: list[AppStatus]
    trainers: list[TrainerStatus] = pydantic.Field(default_factory=list)
    tinker_runs: list[TinkerRunStatus] = pydantic.Field(default_factory=list)


def cluster_status(timeout_s: float = 30.0) -> ClusterStatus:
    """Read from the connected cluster (ray.init first); nothing is started or changed."""
    from ray import serve

    try:
        registry = get_registry()
    except ValueError:  # no registry: nothing was ever published on this cluster
        registry = None
    models = []
    if registry is not None:
        access = ray.get(registry.access.remote(), timeout=timeout_s)
        for version in ray.get(registry.latest_versions.remote(), timeout=timeout_s):
            steps = ray.get(registry.steps.remote(version.model), timeout=timeout_s)
            models.append(
                ModelStatus(
                    model=version.model,
                    base_model=version.base_model,
                    latest_step=version.step,
                    steps=steps,
                    owner=access.owners.get(version.model),
                    release=access.releases.get(version.model),
                )
            )
    apps = []
    tinker_runs: list[TinkerRunStatus] = []
    for name, app in serve.status().applications.items():
        if TINKER_DEPLOYMENT in app.deployments:
            front = serve.get_deployment_handle(TINKER_DEPLOYMENT, name)
            tinker_runs += front.run_statuses.remote().result(timeout_s=timeout_s)
        deployment = app.deployments.get(INFERENCE_DEPLOYMENT)
        if deployment is None:
            continue  # not an art-ray inference app
        running = deployment.replica_states.get("RUNNING", 0)
        replicas = []
        if running:
            handle = serve.get_deployment_handle(INFERENCE_DEPLOYMENT, name)
            replicas = handle.broadcast("served_models").results(timeout_s=timeout_s)
        apps.append(
            AppStatus(
                app_name=name,
                status=str(app.status),
                replicas_running=running,
                replicas=replicas,
            )
        )
    return ClusterStatus(
        models=sorted(models, key=lambda m: m.model),
        apps=apps,
        trainers=_trainers(timeout_s),
        tinker_runs=tinker_runs,
    )


def _trainers(timeout_s: float) -> list[TrainerStatus]:
    trainers = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] != NAMESPACE or not actor["name"].startswith(TRAINER_NAME_PREFIX):
            continue
        try:
            handle = get_cluster_actor(actor["name"])
            runs = ray.get(handle.run_status.remote(), timeout=timeout_s)
        except (ValueError, ray.exceptions.RayError):  # gone meanwhile, or still setting up
            continue
        trainers.append(TrainerStatus(name=actor["name"], runs=runs))
    return sorted(trainers, key=lambda trainer: trainer.name)


def format_status(status: ClusterStatus) -> str:
    lines = ["models (LoRA registry):"]
    if not status.models:
        lines.append("  none published")
    for model in status.models:
        owner = f", owner key {model.owner}" if model.owner else ""
        lines.append(
            f"  {model.model}: latest step {model.latest_step} (steps {model.steps}) on {model.base_model}"
            f"{owner}"
        )
        if model.release is not None:
            lines.append(f"    release: {describe(model.release)}")
    lines.append("inference apps:")
    if not status.apps:
        lines.append("  none running")
    for app in status.apps:
        lines.append(f"  {app.app_name}: {app.status}, {app.replicas_running} replica(s) running")
        for index, served in enumerate(app.replicas):
            versions = ", ".join(f"{model}@{steps}" for model, steps in sorted(served.items())) or "nothing"
            lines.append(f"    replica {index}: {versions}")
    lines.append("trainers:")
    if not status.trainers:
        lines.append("  none running")
    for trainer in status.trainers:
        lines.append(f"  {trainer.name}: {len(trainer.runs)} run(s)")
        for run in trainer.runs:
            live = ", live" if run.live else ""
            lines.append(
                f"    {run.model} ({run.project}): step {run.step}{live}, "
                f"{run.state_bytes / 2**20:.1f} MiB of adapter and optimizer state per rank"
            )
    if status.tinker_runs:
        lines.append("Tinker training clients:")
    for run in status.tinker_runs:
        owner = f", owner key {run.owner}" if run.owner else ""
        lines.append(
            f"  {run.model_id} (run {run.run}): rank-{run.lora_rank} LoRA on {run.base_model}{owner}"
        )
        lines.extend(f"    {path}" for path in run.checkpoints)
    return "\n".join(lines)
