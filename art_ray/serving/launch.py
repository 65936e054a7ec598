"""Start the inference app on the connected Ray cluster, the way Ray users start Serve apps; start and
end the embedded cluster a driver runs when it connects to none."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray
from ray import serve

from art_ray.serve_deploy import proxy_url, run_app, start_serve
from art_ray.serving.config import ServingConfig
from art_ray.serving.replica import build_inference_app

DEFAULT_HOST = "127.0.0.1"


def start_inference(
    config: ServingConfig,
    host: str = DEFAULT_HOST,
    port: int | None = None,
    *,
    deployment: str | None = None,
    how_to_choose: str = "start_inference(port=...)",
) -> str:
    """Deploy (or update) the app and return its OpenAI base URL. Binds 127.0.0.1 unless told otherwise.

    Serve keeps the HTTP options it was first started with on a cluster, so when it already runs the
    URL names where its proxy really listens, not `host`/`port`. When this starts Serve, `port` None takes
    8000 if free, else a free port; a `port` that another process listens on raises PortInUseError
    (art_ray/serve_port.py). `deployment`: the app's identity (art_ray/deployment.py), by default its name
    on this cluster."""
    from art_ray.placement import cluster_shapes

    config = config.placed(cluster_shapes())
    listening = start_serve(host, port, how_to_choose)
    run_app(build_inference_app(config, deployment), name=config.app_name, route_prefix=config.route_prefix)
    return proxy_url(*listening, config.route_prefix) + "/v1"


def stop_inference(app_name: str) -> None:
    """Delete the app and its subscription to adapter versions."""
    from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, get_registry

    ray.get(get_registry().unsubscribe.remote(app_name, INFERENCE_DEPLOYMENT))
    serve.delete(app_name)


# Ray's switch for single-machine clusters (its default on macOS and Windows): the node's address is
# loopback, so every socket of the cluster (GCS, raylet, object manager, workers, agents) binds 127.0.0.1
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray's metrics collection: nothing reads an embedded cluster's metrics (it starts no dashboard and no
# Prometheus), and in an hour's soak it was most of the raylet's memory growth (bench/soak.py)
METRICS_COLLECTION_ENV = "RAY_enable_metrics_collection"
EMBEDDED_RAY_ENV = {LOOPBACK_ONLY_ENV: "0", METRICS_COLLECTION_ENV: "0"}


@contextlib.contextmanager
def embedded_ray() -> Iterator[None]:
    """Around `ray.init` of an embedded cluster: its processes listen on loopback only, and collect no
    metrics. Ray otherwise resolves even 127.0.0.1 to the machine's network address, which its sockets
    then bind, so a laptop on a café network would offer them; a cluster of one machine needs none of
    that. Its processes get both switches from their environment; this process's Ray reads the first at
    import, so it is set for the call."""
    from ray._private import ray_constants

    before_env = {name: os.environ.get(name) for name in EMBEDDED_RAY_ENV}
    before_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(EMBEDDED_RAY_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_flag
        for name, value in before_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def stop_local_cluster() -> None:
    """End a Ray cluster this process started: every Serve app is deleted first (replicas drain and stop
    their engines), then Ray goes with Serve's own actors. Not `serve.shutdown()`: it kills Serve's
    controller while this process's calls to it are retried, which Ray prints as failed tasks."""
    from ray.serve.exceptions import RayServeException

    try:
        applications = list(serve.status().applications)
    except RayServeException:  # Serve never started here
        applications = []
    for app_name in applications:
        serve.delete(app_name)
    ray.shutdown()
