"""The endpoint's outer gate: only the routes art-ray documents are reachable, each behind the API key
when one is set, and every rejection is error JSON in the shape its client expects (Anthropic's on
`/v1/messages`, OpenAI's elsewhere).

Keys: the app's own key is the admin key; run keys (art_ray/access.py) are known from the table the
registry pushes to the replica. The gate puts the Caller it found in the scope (`asgi.CALLER`): the model
names, capture sessions and stored responses inside answer each caller for its own runs only. A run key's
`max_concurrent_requests` is counted here, per replica: past it, a 429.

vLLM's app mounts far more than art-ray serves (its own `/v1/responses` and `/v1/messages` answer as the
base model, `/invocations` bypasses vLLM's key check, `/tokenize`, `/metrics`, `/docs`,
`/scale_elastic_ep`), and its own key check guards `/v1` only and answers `{"error": "Unauthorized"}`. So
the gate sits outside vLLM's middleware and decides before any of vLLM's code runs. `/v1/responses` and
`/v1/messages` reach art-ray's protocol bridge (art_ray/serving/protocol_bridge.py), not vLLM's routes.

The gate also names the deployment (art_ray/deployment.py): every response carries its identity, and a
request that asks for another one (two deployments on one port) is answered 421 before anything else.
"""

from __future__ import annotations

import collections
import hmac
import re
from collections.abc import Callable

import ray

from art_ray.access import AccessTable, key_digest
from art_ray.deployment import DEPLOYMENT_HEADER, MISDIRECTED_STATUS, misdirected_message
from art_ray.serving.asgi import (
    CALLER,
    Caller,
    Message,
    Receive,
    Scope,
    Send,
    presented_key,
    send_anthropic_error,
    send_error,
)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"  # Anthropic Messages
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"
FEEDBACK_PATH = "/v1/feedback"  # art_ray/serving/feedback_route.py
OPENAPI_PATH = "/openapi.json"  # the document of these routes (art_ray/serving/openapi.py)

# capture sessions (art_ray/serving/capture.py): opened here, read and closed at SESSION_RESOURCE, and an
# agent's base URL is `/sessions/{id}/v1`
SESSIONS_PATH = "/v1/capture/sessions"
# a session id is random: the store's, or one a client drew itself (art_ray/capture/store.py)
SESSION_ID = r"[A-Za-z0-9_-]{16,64}"
SESSION_RESOURCE = re.compile(rf"^/v1/capture/sessions/({SESSION_ID})$")
SESSION_ROUTE = re.compile(rf"^/sessions/({SESSION_ID})(/v1/.*)$")

# path -> the method it answers; OPTIONS (a browser's CORS preflight, which carries no key) goes on to
# vLLM's CORS middleware for these paths only
ROUTES = {
    CHAT_PATH: "POST",
    COMPLETIONS_PATH: "POST",
    RESPONSES_PATH: "POST",
    MESSAGES_PATH: "POST",
    MODELS_PATH: "GET",
    HEALTH_PATH: "GET",
    SESSIONS_PATH: "POST",
    FEEDBACK_PATH: "POST",
    OPENAPI_PATH: "GET",
}


def request_path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "")) or scope["path"]


def session_route(path: str) -> tuple[str, str] | None:
    """(session id, the path it stands for) of an agent's session-scoped path, else None."""
    match = SESSION_ROUTE.match(path)
    return (match.group(1), match.group(2)) if match else None


def routed_path(path: str) -> str:
    """The route a path stands for, a session-scoped one's included."""
    routed = session_route(path)
    return routed[1] if routed else path


def route_methods(path: str) -> tuple[str, ...] | None:
    """The methods `path` answers (HEAD with GET), or None when it is no route."""
    path = routed_path(path)
    if SESSION_RESOURCE.match(path):
        return ("GET", "HEAD", "DELETE")
    method = ROUTES.get(path)
    if method is None:
        return None
    return (method, "HEAD") if method == "GET" else (method,)


def requested_deployment(scope: Scope) -> str | None:
    """The deployment identity a request asks for (its `X-Art-Ray-Deployment` header), else None."""
    wanted = dict(scope["headers"]).get(DEPLOYMENT_HEADER.lower().encode())
    return wanted.decode("utf-8", "surrogateescape") if wanted is not None else None


def stamped(send: Send, deployment: str) -> Send:
    """`send` with the deployment's identity added to the response's headers."""
    header = (DEPLOYMENT_HEADER.lower().encode(), deployment.encode())

    async def send_stamped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), header]}
        await send(message)

    return send_stamped


class EndpointGuard:
    """`access()`: the current run keys and owners (the replica's copy of the registry's table);
    `deployment`: this app's identity (art_ray/deployment.py), None to neither stamp nor check it."""

    def __init__(
        self,
        app,  # noqa: ANN001
        api_key: str | None,
        access: Callable[[], AccessTable] = AccessTable,
        deployment: str | None = None,
    ) -> None:
        self.app = app
        self._admin_digest = key_digest(api_key) if api_key else None
        self._access = access
        self._deployment = deployment
        self._in_flight: collections.Counter[str] = collections.Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path, method = request_path(scope), scope.get("method")
        methods = route_methods(path)
        send_error_json = send_anthropic_error if routed_path(path) == MESSAGES_PATH else send_error
        if self._deployment is not None:
            send = stamped(send, self._deployment)
            wanted = requested_deployment(scope)
            # first: a request meant for another deployment learns that, not this one's routes or keys
            if wanted is not None and wanted != self._deployment and scope["type"] == "http":
                message = misdirected_message(wanted, self._deployment)
                await send_error_json(send, MISDIRECTED_STATUS, message, "MisdirectedRequestError")
                return
        if scope["type"] == "websocket" or methods is None:
            routes = ", ".join([*sorted(ROUTES), "/v1/capture/sessions/{id}", "/sessions/{id}/v1/..."])
            await send_error(send, 404, f"Not found: {path}. Routes: {routes}", "NotFoundError")
            return
        if method == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if method not in methods:
            allowed = " or ".join(m for m in methods if m != "HEAD")
            await send_error_json(send, 405, f"{path} takes {allowed}, not {method}", "MethodNotAllowedError")
            return
        caller = self._caller(scope)
        if caller is None and routed_path(path) == FEEDBACK_PATH:
            # a browser posts feedback with the response's signed token instead of a key
            caller = Caller(access=self._access(), authenticated=False)
        if caller is None:
            await send_error_json(
                send,
                401,
                "Missing or incorrect API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                "AuthenticationError",
            )
            return
        scope = {**scope, CALLER: caller}
        limit = caller.grant.max_concurrent_requests if caller.grant else None
        if limit is None:
            await self._serve(scope, receive, send, send_error_json)
            return
        name = caller.grant.name  # type: ignore[union-attr]
        if self._in_flight[name] >= limit:
            message = f"Too many requests in flight for the key {name!r}: at most {limit} at once"
            await send_error_json(send, 429, message, "RateLimitError")
            return
        self._in_flight[name] += 1
        try:
            await self._serve(scope, receive, send, send_error_json)
        finally:
            self._in_flight[name] -= 1

    async def _serve(self, scope: Scope, receive: Receive, send: Send, send_error_json: Callable) -> None:
        """The request, answered 503 (which clients retry) when a cluster actor it needs is restarting: the
        capture store, a traffic log, the response store or the registry (Ray restarts them; a call made
        meanwhile fails). Found by the soak's capture-store kill, answered 500 before."""
        answered = False

        async def answering(message: Message) -> None:
            nonlocal answered
            answered = True
            await send(message)

        try:
            await self.app(scope, receive, answering)
        except ray.exceptions.RayActorError:
            if answered:  # the answer is under way: nothing but the error itself is left to send
                raise
            message = "a part of the deployment this request needs is restarting: retry the request"
            await send_error_json(send, 503, message, "ServiceUnavailableError")

    def _caller(self, scope: Scope) -> Caller | None:
        """The request's Caller, or None when its key is neither a run key nor the admin key."""
        key = presented_key(scope)
        access = self._access()
        grant = access.grant_for(key)
        if grant is not None:
            return Caller(grant, key_digest(key or ""), access)
        if self._admin_digest is None:
            return Caller(None, "", access)
        if key is None or not hmac.compare_digest(key_digest(key), self._admin_digest):
            return None
        return Caller(None, self._admin_digest, access)
