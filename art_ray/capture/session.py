"""A capture session from the client's side: an OpenAI base URL for any agent, and the Trajectory the
endpoint recorded through it.

Plain HTTP to the endpoint (art_ray/serving/capture.py), so it works the same from a RayBackend driver,
an HTTPBackend client, a remote rollout on any node or a process with no Ray at all:

    async with model.capture() as session:
        await my_langgraph_agent(base_url=session.base_url, api_key=session.api_key)
        trajectory = await session.trajectory(reward=score())
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import ssl
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pydantic

from art_ray.capture.turns import CapturedTurn
from art_ray.deployment import deployment_headers
from art_ray.errors import CaptureError

if TYPE_CHECKING:
    import httpx
    from openai import AsyncOpenAI

    from art_ray.model import Model
    from art_ray.trajectories import Trajectory

SESSION_HEADER = "X-Art-Ray-Session"


class CaptureSession(pydantic.BaseModel):
    """`base_url` and `api_key` go to the agent's OpenAI client or framework (`anthropic_base_url` to an
    Anthropic client, which adds `/v1` itself); a client that cannot change its URL sends `headers` on the
    model's own endpoint instead."""

    id: str
    model: str
    endpoint: str  # the model's base URL (.../v1)
    api_key: str | None = None
    # the endpoint's identity (art_ray/deployment.py): every request of the session asks for it, so a
    # deployment sharing the port refuses them instead of recording turns
    deployment: str | None = None
    expires_at: float | None = (
        None  # None: opened by its first completion, `capture_ttl_s` after its last use
    )
    _ended: bool = pydantic.PrivateAttr(default=False)

    @property
    def base_url(self) -> str:
        root = self.endpoint.removesuffix("/").removesuffix("/v1")
        return f"{root}/sessions/{self.id}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {SESSION_HEADER: self.id, **deployment_headers(self.deployment)}

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An OpenAI client on the session's URL. Inside a running event loop it shares that loop's
        connections with every other session's client (a rollout's client costs ~1 ms, not ~25)."""
        from openai import AsyncOpenAI

        if "http_client" not in kwargs:
            with contextlib.suppress(RuntimeError):  # no running loop: the client gets its own connections
                kwargs["http_client"] = _http_client()
        kwargs["default_headers"] = {
            **deployment_headers(self.deployment),
            **kwargs.get("default_headers", {}),
        }
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **kwargs)

    async def turns(self) -> list[CapturedTurn]:
        """Every completion recorded so far, in the order they were stored; the session stays open."""
        self._check_open()
        response = await _request(
            "GET",
            self.endpoint,
            f"/capture/sessions/{self.id}",
            self.api_key,
            self.deployment,
            params={"model": self.model},
        )
        return [CapturedTurn.model_validate(turn) for turn in response["turns"]]

    async def trajectory(
        self, reward: float, metrics: dict[str, float | int | bool] | None = None
    ) -> Trajectory:
        """The recorded turns as one Trajectory (art_ray/capture/assemble.py): each assistant turn the
        exact sampled choice; turns that do not extend the conversation go to `additional_histories`.
        Reading the trajectory ends the session (one request: the turns are read and dropped)."""
        from art_ray.capture.assemble import build_trajectory

        self._check_open()
        path = f"/capture/sessions/{self.id}"
        response = await _request(
            "DELETE", self.endpoint, path, self.api_key, self.deployment, params={"model": self.model}
        )
        self._ended = True
        turns = [CapturedTurn.model_validate(turn) for turn in response["turns"]]
        return build_trajectory(turns, reward, metrics)

    async def art_trajectory(
        self, reward: float, metrics: dict[str, float | int | bool] | None = None
    ) -> Any:
        """`trajectory()` as ART's `art.Trajectory`, for ART scripts (needs openpipe-art)."""
        from art_ray.art_backend import trajectory_to_art

        return trajectory_to_art(await self.trajectory(reward, metrics))

    async def close(self) -> None:
        """Drop the recorded turns (a session also expires `ttl_s` after its last use)."""
        if not self._ended:
            self._ended = True
            await _request(
                "DELETE",
                self.endpoint,
                f"/capture/sessions/{self.id}",
                self.api_key,
                self.deployment,
                missing_ok=True,
            )

    def _check_open(self) -> None:
        if self._ended:
            raise CaptureError(
                f"capture session {self.id!r} has ended: its trajectory was read or it was closed"
            )


async def open_session(model: Model | Any, ttl_s: float | None = None) -> CaptureSession:
    """`model`: an art_ray Model, or ART's (`inference_base_url`, `inference_api_key`). Without `ttl_s`
    the session's id is drawn here and its first completion opens it on the endpoint (no round trip
    before the agent runs); with `ttl_s` the endpoint opens it first, with that lifetime."""
    endpoint = getattr(model, "base_url", None) or getattr(model, "inference_base_url", None)
    api_key = getattr(model, "api_key", None) or getattr(model, "inference_api_key", None)
    deployment = getattr(model, "deployment", None)  # ART's models have none: their requests go unchecked
    if endpoint is None:
        raise CaptureError(f"model {model.name!r} has no endpoint: register it (or set base_url) first")
    if ttl_s is None:
        return CaptureSession(
            id=secrets.token_urlsafe(24),
            model=model.name,
            endpoint=endpoint,
            api_key=api_key,
            deployment=deployment,
        )
    info = await _request(
        "POST",
        endpoint,
        "/capture/sessions",
        api_key,
        deployment,
        json={"model": model.name, "ttl_s": ttl_s},
    )
    return CaptureSession(
        id=info["id"],
        model=info["model"],
        endpoint=endpoint,
        api_key=api_key,
        deployment=deployment,
        expires_at=info["expires_at"],
    )


@asynccontextmanager
async def capture_session(model: Model | Any, ttl_s: float | None = None) -> AsyncIterator[CaptureSession]:
    """Open a session, hand it to the block, close it afterwards (read the trajectory inside). Also for
    ART's models: `async with art_ray.capture_session(art_model) as session`."""
    session = await open_session(model, ttl_s)
    try:
        yield session
    finally:
        await session.close()


async def _request(
    method: str,
    endpoint: str,
    path: str,
    api_key: str | None,
    deployment: str | None,
    missing_ok: bool = False,
    **kwargs: Any,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(deployment_headers(deployment))
    response = await _http_client().request(
        method, endpoint.rstrip("/") + path, headers=headers, timeout=60, **kwargs
    )
    if response.status_code == 404 and missing_ok:
        return {}
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise CaptureError(f"{method} {path}: {response.status_code} {message}")
    return response.json()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """Loading the CA bundle is most of an HTTP client's ~25 ms start."""
    import httpx

    return httpx.create_ssl_context()


@functools.cache
def _shared_client_type() -> type[httpx.AsyncClient]:
    from openai import DefaultAsyncHttpxClient

    class SharedHttpClient(DefaultAsyncHttpxClient):
        """Shared by the sessions of one event loop: an OpenAI client's close() leaves it open."""

        async def aclose(self) -> None:
            pass

    return SharedHttpClient


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def _http_client() -> httpx.AsyncClient:
    """One client (and its kept-alive connections) per event loop, for the session requests and the
    sessions' OpenAI clients. RuntimeError outside a running loop."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = _shared_client_type()(verify=_ssl_context())
    return _clients[loop]
