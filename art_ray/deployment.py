"""Deployment identity: which art-ray app on which Ray cluster answered a request.

Two Serve proxies can listen on one port (Ray Serve binds with SO_REUSEPORT), and the kernel then splits
connections between them. The port check before Serve starts (art_ray/serve_port.py) keeps art-ray from
doing that; the identity makes a mix-up that happens anyway an error instead of a sample: each app stamps
its identity on every response (`DEPLOYMENT_HEADER`), the SDK's clients send the identity they expect, and
an app answers a request that expects another one with 421 Misdirected Request. A request without the
header (curl, other clients) is served as before.

On the floor: nothing here imports ray at module level.
"""

from __future__ import annotations

import secrets

DEPLOYMENT_HEADER = "X-Art-Ray-Deployment"
MISDIRECTED_STATUS = 421  # Misdirected Request: OpenAI's and Tinker's clients do not retry it


def deployment_identity(app_name: str) -> str:
    """`app@session`: the app's name and its Ray cluster's session name, which differs between any two
    clusters (and so between any two Serve instances, one per cluster). Anyone on the cluster computes the
    same value; a random one stands in where the session is not known (no Ray connected)."""
    try:
        import ray

        session = ray.get_runtime_context().get_session_name()
    except Exception:  # noqa: BLE001 - not connected, or a client connection without a local node
        session = f"unknown-{secrets.token_hex(6)}"
    return f"{app_name}@{session}"


def deployment_headers(deployment: str | None) -> dict[str, str]:
    """The header a client sends so that only `deployment` answers it (none when it is unknown)."""
    return {DEPLOYMENT_HEADER: deployment} if deployment else {}


def misdirected_message(expected: str, actual: str) -> str:
    return (
        f"This request was meant for the art-ray deployment {expected!r} but reached {actual!r}. Two "
        "deployments most likely listen on one port (Ray Serve's proxy binds with SO_REUSEPORT, so the "
        "kernel splits requests between them); nothing was sampled or trained. Give each its own port "
        "(RayBackend(port=...), art-ray serve-training --port) or stop the other one."
    )
