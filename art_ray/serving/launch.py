"""Start the inference app on the connected Ray cluster, the way Ray users start Serve apps."""

from __future__ import annotations

from ray import serve

from art_ray.serving.config import ServingConfig
from art_ray.serving.replica import build_inference_app

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def start_inference(config: ServingConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    """Deploy (or update) the app and return its OpenAI base URL. Binds 127.0.0.1 unless told otherwise."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_inference_app(config), name=config.app_name, route_prefix=config.route_prefix)
    return f"http://{host}:{port}{config.route_prefix.rstrip('/')}/v1"


def stop_inference(app_name: str) -> None:
    serve.delete(app_name)
