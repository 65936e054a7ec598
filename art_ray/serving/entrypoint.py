"""Serve config file entry point: `import_path: art_ray.serving.entrypoint:app_builder`.

`args` are ServingConfig fields; `engine.model` may be a local model name (`tiny`, `smollm2-135m`),
a path or a hub id. Example: deploy/serve_config.yaml (`serve run deploy/serve_config.yaml`).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from art_ray.models import resolve_base_model
from art_ray.serving.config import ServingConfig
from art_ray.serving.replica import build_inference_app


def app_builder(args: dict[str, Any]) -> serve.Application:
    from art_ray.placement import cluster_shapes

    config = ServingConfig.model_validate(args)
    engine = config.engine.model_copy(update={"model": resolve_base_model(config.engine.model)})
    return build_inference_app(config.model_copy(update={"engine": engine}).placed(cluster_shapes()))
