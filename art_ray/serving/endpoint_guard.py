"""The endpoint's outer gate: only the routes art-ray documents are reachable, each behind the API key
when one is set, and every rejection is error JSON in the shape its client expects (Anthropic's on
`/v1/messages`, OpenAI's elsewhere).

vLLM's app mounts far more than art-ray serves (its own `/v1/responses` and `/v1/messages` answer as the
base model, `/invocations` bypasses vLLM's key check, `/tokenize`, `/metrics`, `/docs`,
`/scale_elastic_ep`), and its own key check guards `/v1` only and answers `{"error": "Unauthorized"}`. So
the gate sits outside vLLM's middleware and decides before any of vLLM's code runs. `/v1/responses` and
`/v1/messages` reach art-ray's protocol bridge (art_ray/serving/protocol_bridge.py), not vLLM's routes.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from art_ray.serving.asgi import Receive, Scope, Send, presented_key, send_anthropic_error, send_error

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"  # Anthropic Messages
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"

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


class EndpointGuard:
    def __init__(self, app, api_key: str | None) -> None:  # noqa: ANN001
        self.app = app
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path, method = request_path(scope), scope.get("method")
        methods = route_methods(path)
        send_error_json = send_anthropic_error if routed_path(path) == MESSAGES_PATH else send_error
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
        if not self._authorized(scope):
            await send_error_json(
                send,
                401,
                "Missing or incorrect API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                "AuthenticationError",
            )
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        if self._key_digest is None:
            return True
        key = presented_key(scope)
        if key is None:
            return False
        return hmac.compare_digest(hashlib.sha256(key.encode("latin-1")).digest(), self._key_digest)
