"""Deploy a Serve application the way Ray users do (`serve.start`, then `serve.run`), for every art-ray app.

`serve.run` starts Serve again under the hood and, Serve being up, logs "Connecting to existing Serve app
... New http_options/controller_options will not be applied." on every deploy, a fresh start included: a
user reads it as their settings being ignored. Here Serve is started once, and joining a running one says
so only when it runs with a port other than the one asked for.

Before Serve starts, its port is checked on the node its first proxy binds on (the head): Serve's proxy
binds with SO_REUSEPORT and would share a port another process listens on (art_ray/serve_port.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import ray
from ray import serve

from art_ray.serve_port import choose_port, free_port, machine_lock, port_holder

CONNECTING_TO_EXISTING = "Connecting to existing Serve app"
logger = logging.getLogger(__name__)
Result = TypeVar("Result")


class _DropReconnectNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(CONNECTING_TO_EXISTING)


@contextmanager
def _quiet_reconnect() -> Iterator[None]:
    logger = logging.getLogger("ray.serve")
    notice_filter = _DropReconnectNotice()
    logger.addFilter(notice_filter)
    try:
        yield
    finally:
        logger.removeFilter(notice_filter)


def start_serve(host: str, port: int | None, how_to_choose: str = "port=...") -> tuple[str, int]:
    """Start Serve with its proxy on host:port, or join the Serve already running on this cluster; returns
    the host and port its proxy really listens on (a running Serve keeps the options it was started with).

    Serve is only started on a port no other process listens on: a `port` asked for that is held raises
    PortInUseError (`how_to_choose` says how to pick another); `None` takes 8000 if free, else a free port
    and says which. The cluster's own proxy is never a conflict: a running Serve is joined, not probed."""
    running = _running_serve()
    if running is not None:
        if port is not None and (running.host, running.port) != (host, port):
            logger.warning(
                "Serve already runs on this Ray cluster with its proxy on %s:%d: joining it (%s:%d is "
                "not used)",
                running.host,
                running.port,
                host,
                port,
            )
        return running.host, running.port
    if _on_head_node():
        with machine_lock():  # until this proxy listens, so that another art-ray process's probe sees it
            chosen = choose_port(host, port, how_to_choose)
            serve.start(http_options={"host": host, "port": chosen})  # returns once its proxies listen
    else:  # the head's ports are probed on the head (no lock: it is another machine)
        chosen = choose_port(host, port, how_to_choose, probe=_on_head(port_holder), free=_on_head(free_port))
        serve.start(http_options={"host": host, "port": chosen})
    http = _running_serve()
    assert http is not None
    return http.host, http.port


def _running_serve() -> Any:  # noqa: ANN401 - Serve's HTTPOptions
    """The HTTP options of the Serve running on the connected cluster, or None when none runs."""
    from ray.serve.context import _get_global_client
    from ray.serve.exceptions import RayServeException

    try:
        return _get_global_client().http_config
    except RayServeException:
        return None


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's own marker resource of the head node


def _head_node_id() -> str | None:
    return next(
        (node["NodeID"] for node in ray.nodes() if node["Alive"] and HEAD_NODE_RESOURCE in node["Resources"]),
        None,
    )


def _on_head_node() -> bool:
    """Whether this process runs on the head node, where serve.start puts its first proxy."""
    from ray.util.client import ray as client_ray

    if client_ray.is_connected():  # ray:// : this process is not on any node
        return False
    head = _head_node_id()
    return head is None or head == ray.get_runtime_context().get_node_id()


def _on_head(function: Callable[..., Result]) -> Callable[..., Result]:
    """`function` run as a task on the head node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def call(*args: Any) -> Result:  # noqa: ANN401
        strategy = NodeAffinitySchedulingStrategy(_head_node_id(), soft=False)
        task = ray.remote(function).options(num_cpus=0, scheduling_strategy=strategy)
        return ray.get(task.remote(*args))

    return call


def proxy_url(host: str, port: int, route_prefix: str = "/") -> str:
    """The URL a client on this machine dials for an app at route_prefix (a wildcard host is loopback)."""
    dial = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{dial}:{port}{route_prefix.rstrip('/')}"


def run_app(app: Any, name: str, route_prefix: str) -> None:  # noqa: ANN401 - a Serve Application
    """`serve.run` on the Serve that start_serve started or joined."""
    with _quiet_reconnect():
        serve.run(app, name=name, route_prefix=route_prefix)
