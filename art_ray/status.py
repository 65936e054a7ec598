"""What runs on a cluster: the models the LoRA registry knows and what each inference replica serves."""

from __future__ import annotations

import pydantic
import ray

from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, get_registry


class ModelStatus(pydantic.BaseModel):
    model: str
    base_model: str
    latest_step: int
    steps: list[int]


class AppStatus(pydantic.BaseModel):
    app_name: str
    status: str
    replicas_running: int
    # per replica: model -> the steps it serves
    replicas: list[dict[str, list[int]]]


class ClusterStatus(pydantic.BaseModel):
    models: list[ModelStatus]
    apps: list[AppStatus]


def cluster_status(timeout_s: float = 30.0) -> ClusterStatus:
    """Read from the connected cluster (ray.init first); nothing is started or changed."""
    from ray import serve

    try:
        registry = get_registry()
    except ValueError:  # no registry: nothing was ever published on this cluster
        registry = None
    models = []
    if registry is not None:
        for version in ray.get(registry.latest_versions.remote(), timeout=timeout_s):
            steps = ray.get(registry.steps.remote(version.model), timeout=timeout_s)
            models.append(
                ModelStatus(
                    model=version.model, base_model=version.base_model, latest_step=version.step, steps=steps
                )
            )
    apps = []
    for name, app in serve.status().applications.items():
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
    return ClusterStatus(models=sorted(models, key=lambda m: m.model), apps=apps)


def format_status(status: ClusterStatus) -> str:
    lines = ["models (LoRA registry):"]
    if not status.models:
        lines.append("  none published")
    for model in status.models:
        lines.append(
            f"  {model.model}: latest step {model.latest_step} (steps {model.steps}) on {model.base_model}"
        )
    lines.append("inference apps:")
    if not status.apps:
        lines.append("  none running")
    for app in status.apps:
        lines.append(f"  {app.app_name}: {app.status}, {app.replicas_running} replica(s) running")
        for index, served in enumerate(app.replicas):
            versions = ", ".join(f"{model}@{steps}" for model, steps in sorted(served.items())) or "nothing"
            lines.append(f"    replica {index}: {versions}")
    return "\n".join(lines)
