"""ASGI types, the key a request presents, and the error JSON (OpenAI's or Anthropic's shape) shared by the
endpoint's middleware."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

from art_ray.access import AccessTable, KeyGrant

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def send_error(
    send: Send, status: int, message: str, error_type: str, param: str | None = None
) -> None:
    error = {"message": message, "type": error_type, "param": param, "code": status}
    await send_json(send, status, {"error": error})


def unknown_model(model: str) -> str:
    """vLLM's 404 message for a model it does not serve: what a hidden run is answered with too, word for
    word, so another key cannot tell it from a name nobody registered."""
    return f"The model `{model}` does not exist."


# OpenAI's error `type` by the status art-ray's own middleware answers with
OPENAI_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
}

# Anthropic's error `type` by status (https://docs.anthropic.com/en/api/errors); clients raise by status
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


async def send_anthropic_error(
    send: Send, status: int, message: str, error_type: str = "", param: str | None = None
) -> None:
    """`send_error`'s signature, in Anthropic's shape (which has no OpenAI type or param)."""
    await send_json(send, status, anthropic_error(status, message))


def presented_key(scope: Scope) -> str | None:
    """The API key a request carries: `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>`
    (Anthropic clients); None when it carries neither."""
    headers = dict(scope["headers"])
    scheme, _, token = headers.get(b"authorization", b"").decode("utf-8", "surrogateescape").partition(" ")
    if scheme.lower() == "bearer":
        return token
    key = headers.get(b"x-api-key")
    return key.decode("utf-8", "surrogateescape") if key is not None else None


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who made a request, as the endpoint's gate (art_ray/serving/endpoint_guard.py) found: `grant`, the
    run key's (None: the admin key, or anyone on a keyless endpoint); `binding`, what stored state
    (capture sessions, stored responses) is bound to: the key's SHA-256 digest, "" on a keyless
    endpoint for a caller with no run key (clients there send made-up keys, which differ from client to
    client); `access`, the keys and owners the gate judged by. `authenticated` False: a request without
    a key that the gate let through to a route that authorizes it otherwise (feedback with a signed
    token), never to be taken for the admin."""

    grant: KeyGrant | None = None
    binding: str = ""
    access: AccessTable = dataclasses.field(default_factory=AccessTable)
    authenticated: bool = True

    def sees(self, model: str) -> bool:
        return self.access.sees(self.grant, model)


CALLER = "art_ray.caller"  # the scope's key for the Caller


def caller_of(scope: Scope) -> Caller:
    return scope.get(CALLER) or Caller()


async def send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def with_content_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    """`headers` with their content-length replaced by `length` (a rewritten body's)."""
    kept = [(key, value) for key, value in headers if key.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]


def with_path(scope: Scope, path: str) -> Scope:
    """`scope` for another route under the same root path."""
    full = scope.get("root_path", "") + path
    return {**scope, "path": full, "raw_path": full.encode()}


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """Hand the (rewritten) body over once, then the client's own messages: vLLM cancels a request
    when it sees `http.disconnect`, so that must only come from a real disconnect."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
