"""The Responses API and Anthropic Messages, served through the endpoint's chat completions.

A request to `/v1/responses` or `/v1/messages` (a session-scoped `/sessions/{id}/v1/...` one included) is
translated into a chat completion request and sent on, inside the replica, as `/v1/chat/completions`; its
answer, JSON or a stream, is translated back into the client's protocol. So everything the endpoint does
for chat holds for both protocols at once, with no second code path: model names and versions, the `n` and
token limits, the tool-call grammar, abort on disconnect, and capture, which records the chat turn with
its sampled token ids, logprobs and policy version (the trainer's view of a turn is a chat turn whatever
protocol the agent spoke). Errors, the chat route's included, go out in the protocol's own shape.

vLLM mounts its own `/v1/responses` and `/v1/messages`; they are not used: vLLM's Responses path does not
go through chat (no tool grammar, no token ids on tool calls), and both would need capture written twice.
The translation itself is vLLM's where vLLM has one (Anthropic both ways, Responses input items).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import pydantic

from art_ray.serving.asgi import (
    OPENAI_ERROR_TYPES,
    Message,
    Receive,
    Scope,
    Send,
    caller_of,
    read_body,
    replay,
    send_json,
    with_content_length,
    with_path,
)
from art_ray.serving.endpoint_guard import CHAT_PATH, request_path, routed_path


class BridgeRequestError(Exception):
    """A request the bridge cannot translate: answered with `status` in the protocol's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class ChatBridge(Protocol):
    """One protocol's translation to and from chat completions (payloads are JSON-shaped dicts). `caller`
    is the SHA-256 of the request's key ("" on an endpoint without one): what state a protocol keeps
    between requests is bound to it."""

    async def chat_request(self, payload: dict[str, Any], caller: str) -> dict[str, Any]:
        """The chat completion request for `payload`; raises BridgeRequestError."""
        ...

    async def response(self, chat: dict[str, Any], payload: dict[str, Any], caller: str) -> dict[str, Any]:
        """The protocol's response for a chat completion."""
        ...

    def stream(self, chunks: AsyncIterator[str], payload: dict[str, Any], caller: str) -> AsyncIterator[str]:
        """The protocol's server-sent events for a chat completion's (`data: ...` items, `[DONE]` last)."""
        ...

    def error(self, status: int, message: str, error_type: str, param: str | None) -> dict[str, Any]:
        """The protocol's error body."""
        ...


class ProtocolBridge:
    """ASGI middleware: `bridges` maps a route (`/v1/responses`, `/v1/messages`) to its ChatBridge. What a
    bridge stores is bound to the caller's binding (asgi.Caller)."""

    def __init__(self, app: Callable, bridges: dict[str, ChatBridge]) -> None:
        self.app = app
        self._bridges = bridges

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        path = request_path(scope)
        route = routed_path(path)
        bridge = self._bridges.get(route)
        if bridge is None:
            await self.app(scope, receive, send)
            return
        try:
            payload = json.loads(await read_body(receive))
        except ValueError:
            payload = None
        caller = caller_of(scope).binding
        try:
            if not isinstance(payload, dict):
                raise BridgeRequestError(400, "the request body must be a JSON object")
            chat = await bridge.chat_request(payload, caller)
        except BridgeRequestError as error:
            body = bridge.error(error.status, str(error), OPENAI_ERROR_TYPES[error.status], error.param)
            await send_json(send, error.status, body)
            return
        body = json.dumps(chat).encode()
        scope = with_path(scope, path[: len(path) - len(route)] + CHAT_PATH)
        scope["headers"] = with_content_length(scope["headers"], len(body))
        inner_receive = replay(body, receive)
        call = _Call(bridge, payload, caller)
        if chat.get("stream"):
            await self._stream(call, scope, inner_receive, send)
        else:
            await self._unary(call, scope, inner_receive, send)

    async def _unary(self, call: _Call, scope: Scope, receive: Receive, send: Send) -> None:
        answer = _Buffered()
        await self.app(scope, receive, answer.send)
        await answer.translate(call, send)

    async def _stream(self, call: _Call, scope: Scope, receive: Receive, send: Send) -> None:
        events = _EventQueue()
        inner = asyncio.ensure_future(self.app(scope, receive, events.send))
        try:
            status = await events.status(inner)
            if status != 200:  # an error answers as JSON: translate it whole
                await inner
                await events.buffered.translate(call, send)
                return
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for event in call.bridge.stream(events.items(), call.payload, call.caller):
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            await inner
        finally:
            if not inner.done():
                inner.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await inner


@dataclasses.dataclass(frozen=True)
class _Call:
    """One bridged request: its protocol, the client's payload and who asked."""

    bridge: ChatBridge
    payload: dict[str, Any]
    caller: str


class _Buffered:
    """A whole answer of the chat route: its status and body."""

    def __init__(self) -> None:
        self.status = 0
        self.chunks: list[bytes] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))

    async def translate(self, call: _Call, send: Send) -> None:
        try:
            body = json.loads(b"".join(self.chunks))
        except ValueError:
            body = None
        if self.status == 200 and isinstance(body, dict):
            await send_json(send, 200, await call.bridge.response(body, call.payload, call.caller))
            return
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):  # vLLM's own shapes, e.g. {"error": "Unauthorized"} or a detail
            error = {"message": str(error or body or "the chat completion failed"), "type": "APIError"}
        status = self.status if self.status >= 400 else 500
        message = str(error.get("message", ""))
        await send_json(
            send, status, call.bridge.error(status, message, str(error.get("type")), error.get("param"))
        )


class _EventQueue:
    """A streamed answer of the chat route as its server-sent `data:` items, as they arrive."""

    def __init__(self) -> None:
        self.buffered = _Buffered()
        self._started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._bodies: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" or self.buffered.status != 200:
            await self.buffered.send(message)  # an error's body is translated whole
            if not self._started.done() and self.buffered.status:
                self._started.set_result(self.buffered.status)
        elif message["type"] == "http.response.body":
            await self._bodies.put(message.get("body", b""))
            if not message.get("more_body"):
                await self._bodies.put(None)

    async def status(self, app: asyncio.Future[None]) -> int:
        """The answer's status once it starts (the app's own error if it fails before)."""
        await asyncio.wait((self._started, app), return_when=asyncio.FIRST_COMPLETED)
        if not self._started.done():
            app.result()  # raises the app's error
            return 500  # the app ended without answering
        return self._started.result()

    async def items(self) -> AsyncIterator[str]:
        pending = ""
        while (body := await self._bodies.get()) is not None:
            pending += body.decode("utf-8")
            *complete, pending = pending.split("\n\n")
            for event in complete:
                for line in event.splitlines():
                    if line.startswith("data:"):
                        yield line + "\n\n"
        for line in pending.splitlines():
            if line.startswith("data:"):
                yield line + "\n\n"


# vLLM's own sampling settings, which its chat route takes beside OpenAI's (`extra_body` in the openai
# SDK, `extra_body` in the anthropic one): a client that sends them on either protocol gets them too
SAMPLING_EXTRAS = (
    "ignore_eos",
    "min_tokens",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
    "top_k",
)


def sampling_extras(payload: dict[str, Any]) -> dict[str, Any]:
    return {key: payload[key] for key in SAMPLING_EXTRAS if payload.get(key) is not None}


def validation_message(error: pydantic.ValidationError) -> str:
    """The first problems of a request as `field: message` (pydantic's own text is long and repeats)."""
    problems = [
        f"{'.'.join(str(part) for part in problem['loc']) or 'body'}: {problem['msg']}"
        for problem in error.errors()[:3]
    ]
    return "invalid request: " + "; ".join(problems)


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"
