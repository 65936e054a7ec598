"""Deploy a Serve application the way Ray users do (`serve.start`, then `serve.run`), for every art-ray app.

`serve.run` starts Serve again under the hood and, Serve being up, logs "Connecting to existing Serve app
... New http_options/controller_options will not be applied." on every deploy, a fresh start included: a
user reads it as their settings being ignored. Here `serve.start` alone speaks, and it says so only when
Serve was already running with options of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ray import serve

CONNECTING_TO_EXISTING = "Connecting to existing Serve app"


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


def start_serve(host: str, port: int) -> tuple[str, int]:
    """Start Serve with its proxy on host:port, or join the Serve already running; returns the host and
    port its proxy really listens on (a running Serve keeps the options it was started with)."""
    from ray.serve.context import _get_global_client

    serve.start(http_options={"host": host, "port": port})
    http = _get_global_client().http_config
    return http.host, http.port


def proxy_url(host: str, port: int, route_prefix: str = "/") -> str:
    """The URL a client on this machine dials for an app at route_prefix (a wildcard host is loopback)."""
    dial = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{dial}:{port}{route_prefix.rstrip('/')}"


def run_app(app: Any, name: str, route_prefix: str) -> None:  # noqa: ANN401 - a Serve Application
    """`serve.run` on the Serve that start_serve started or joined."""
    with _quiet_reconnect():
        serve.run(app, name=name, route_prefix=route_prefix)
