"""Server-side capture: the endpoint records what it sampled in a capture session, for any client.

Routes (under the app's prefix, behind the key like every route):
- `POST /v1/capture/sessions` `{"model": name, "ttl_s": optional}` opens a session bound to the caller's
  key and that model: `{"id", "model", "expires_at"}`. Or the client draws a random id itself (16-64 URL-safe
  characters): its first completion opens the session (`capture_ttl_s`), with no round trip before it.
- An agent then calls `/sessions/{id}/v1/chat/completions` (give any OpenAI client the base URL
  `.../sessions/{id}/v1`), or `/v1/chat/completions` with the header `X-Art-Ray-Session: {id}`.
- `GET /v1/capture/sessions/{id}?model=name` returns `{"id", "model", "turns"}`; `DELETE` closes it and
  answers the turns it dropped (how `trajectory()` reads and ends a session in one request).

Each chat completion in a session is recorded as a CapturedTurn: the request's messages and tools as sent,
and the choice as the client received it (with its token ids, logprobs, prompt token ids and policy
version; a stream is assembled from its chunks). The Responses API and Anthropic Messages reach this
middleware as chat completions (art_ray/serving/protocol_bridge.py), so they are recorded the same way. A
text completion (`/v1/completions`, one prompt) is recorded as a one-message conversation whose choice is
in chat's shape (completion_as_chat_choice). The turn is appended to the cluster's capture store before the
response's last byte goes out. A session records one choice per request (`n` must be 1).

Traffic: a completion for a run that stores its traffic (`ModelConfig.traffic`; the access table lists
them) is appended to the run's traffic log the same way, unless the request says `"store": false` or
asks for several choices or prompts (feedback names one reply). Its response carries a signed feedback
token (`X-Art-Ray-Feedback-Token`, art_ray/serving/feedback_token.py), so its header waits for the
body's first bytes, which hold the completion id.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from art_ray.adapters.spec import InvalidModelNameError, parse_versioned_name
from art_ray.capture.session_api import OpenSessionRequest, SessionTurns
from art_ray.capture.turns import CapturedTurn
from art_ray.feedback import request_metadata
from art_ray.sampling import CHOICE_KEY, SamplingParams
from art_ray.serving.asgi import (
    OPENAI_ERROR_TYPES,
    Message,
    Receive,
    Scope,
    Send,
    caller_of,
    read_body,
    replay,
    send_error,
    send_json,
    unknown_model,
    with_path,
)
from art_ray.serving.endpoint_guard import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    SESSION_ID,
    SESSION_RESOURCE,
    SESSIONS_PATH,
    request_path,
    session_route,
)
from art_ray.serving.feedback_token import FEEDBACK_TOKEN_HEADER, FeedbackSigner
from art_ray.serving.traffic_logs import TrafficLogs
from art_ray.traffic.records import StoredTurn

logger = logging.getLogger(__name__)

SESSION_HEADER = b"x-art-ray-session"
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"]{1,256})"')


class CaptureMiddleware:
    """`store()`: the capture store's actor handle (looked up on first use). Sessions are bound to the
    caller's binding (asgi.Caller): on a keyless endpoint, for callers without a run key, none (their
    sessions are reached by their random id alone)."""

    def __init__(
        self,
        app: Callable,
        store: Callable[[], Any],
        traffic_logs: TrafficLogs | None = None,
        signer: FeedbackSigner | None = None,
    ) -> None:
        self.app = app
        self._store_lookup = store
        self._store: Any = None
        self._traffic_logs = traffic_logs or TrafficLogs()
        self._signer = signer

    def _key_digest(self, scope: Scope) -> str:
        return caller_of(scope).binding

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = self._store_lookup()
        return self._store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = request_path(scope), scope["method"]
        if path == SESSIONS_PATH and method == "POST":
            await self._open(scope, receive, send)
            return
        if match := SESSION_RESOURCE.match(path):
            await self._resource(scope, send, match.group(1), method)
            return
        session_id = dict(scope["headers"]).get(SESSION_HEADER, b"").decode("latin-1") or None
        if routed := session_route(path):
            session_id, path = routed
            scope = with_path(scope, path)
        stores_traffic = bool(caller_of(scope).access.traffic)
        if method != "POST" or (session_id is None and not stores_traffic):
            await self.app(scope, receive, send)
            return
        if session_id is not None and not re.fullmatch(SESSION_ID, session_id):
            message = (
                f"a capture session id is 16-64 characters of A-Z, a-z, 0-9, _ and -, not {session_id!r}"
            )
            await send_error(send, 400, message, "BadRequestError")
            return
        if path not in (CHAT_PATH, COMPLETIONS_PATH):
            await self.app(scope, receive, send)
            return
        await self._record(scope, receive, send, session_id, chat=path == CHAT_PATH)

    async def _open(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            request = OpenSessionRequest.model_validate_json(await read_body(receive))
            model, ttl_s = request.model, request.ttl_s
            if parse_versioned_name(model)[1] is not None:
                raise ValueError
        except (ValueError, InvalidModelNameError):  # pydantic's ValidationError is a ValueError
            message = (
                'open a session with {"model": "<model name, without @step>", "ttl_s": optional seconds}'
            )
            await send_error(send, 400, message, "BadRequestError")
            return
        if not caller_of(scope).sees(model):  # another run's model: as if it did not exist
            await send_error(send, 404, unknown_model(model), "NotFoundError", "model")
            return
        info = await self.store.open.remote(model, self._key_digest(scope), ttl_s)
        await send_json(send, 200, info.model_dump())

    async def _resource(self, scope: Scope, send: Send, session_id: str, method: str) -> None:
        digest = self._key_digest(scope)
        model = parse_qs(scope.get("query_string", b"").decode()).get("model", [None])[0]
        if method == "DELETE":  # answers the turns it dropped: reading a trajectory ends its session
            turns = await self.store.close.remote(session_id, digest, model)
        else:
            turns = await self.store.read.remote(session_id, digest, model or "")
        if turns is not None:
            body = SessionTurns(id=session_id, model=model, turns=turns, deleted=method == "DELETE" or None)
            await send_json(send, 200, body.model_dump(exclude=None if body.deleted else {"deleted"}))
            return
        await send_error(send, 404, f"capture session {session_id!r} not found or expired", "NotFoundError")

    async def _record(
        self, scope: Scope, receive: Receive, send: Send, session_id: str | None, chat: bool
    ) -> None:
        body = await read_body(receive)
        try:
            payload = json.loads(body)
            name = parse_versioned_name(payload["model"])[0]
        except (ValueError, KeyError, TypeError, InvalidModelNameError):
            # not recordable; the model-name middleware or vLLM answers it with its own 400
            await self.app(scope, replay(body, receive), send)
            return
        if payload.get("store") not in (None, True, False):
            message = "`store` is true (the default) or false (this completion is not stored for training)"
            await send_error(send, 400, message, "BadRequestError", "store")
            return
        try:
            request_metadata(payload)
        except ValueError as error:
            await send_error(send, 400, str(error), "BadRequestError", "metadata")
            return
        prompt = None if chat else payload.get("prompt")
        traffic = None
        caller = caller_of(scope)
        if (
            name in caller.access.traffic
            and caller.sees(name)
            and payload.get("store") is not False
            and (caller.grant is None or caller.grant.store_traffic)
            and payload.get("n") in (None, 1)
            and (chat or _single_prompt(prompt))
        ):
            traffic = self._traffic_logs.get(name)
        if session_id is None:
            if traffic is None:
                await self.app(scope, replay(body, receive), send)
            else:
                await self._recorded(scope, receive, send, body, payload, chat, None, (name, traffic))
            return
        if not chat and not _single_prompt(prompt):
            message = "a capture session records one prompt per completion: a string or a list of token ids"
            await send_error(send, 400, message, "BadRequestError", "prompt")
            return
        if payload.get("n") not in (None, 1):
            await send_error(
                send,
                400,
                "a capture session records one choice per request: `n` must be 1",
                "BadRequestError",
                "n",
            )
            return
        refused = await self.store.admit.remote(session_id, self._key_digest(scope), name)
        if refused is not None:
            await send_error(send, refused.status, refused.message, OPENAI_ERROR_TYPES[refused.status])
            return
        await self._recorded(
            scope, receive, send, body, payload, chat, session_id, (name, traffic) if traffic else None
        )

    async def _recorded(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        payload: dict[str, Any],
        chat: bool,
        session_id: str | None,
        traffic: tuple[str, Any] | None,
    ) -> None:
        """Serve the request, and before its last byte store its turn: in the capture session
        `session_id`, and in the traffic log of `traffic` (the run and its log's handle)."""
        digest = self._key_digest(scope)
        response = _Response(stream=bool(payload.get("stream")), chat=chat)
        request_messages = (
            (payload.get("messages") or []) if chat else _prompt_messages(payload.get("prompt"))
        )
        sampling = SamplingParams.of_request(payload)
        held_start: Message | None = None

        async def recorded(message: Message) -> None:
            nonlocal held_start
            if message["type"] == "http.response.start":
                response.status = message["status"]
                if traffic is not None and response.status == 200 and self._signer is not None:
                    held_start = message  # its token needs the completion id, in the body's first bytes
                    return
            elif message["type"] == "http.response.body" and response.status == 200:
                response.feed(message.get("body", b""))
                if held_start is not None:
                    await send(self._with_token(held_start, traffic[0], message.get("body", b"")))
                    held_start = None
                if not message.get("more_body"):  # the last byte waits until the turn is stored
                    await self._store_turn(
                        response, payload, request_messages, sampling, session_id, digest, traffic
                    )
            await send(message)

        await self.app(scope, replay(body, receive), recorded)

    def _with_token(self, start: Message, run: str, first_bytes: bytes) -> Message:
        assert self._signer is not None
        found = RESPONSE_ID.search(first_bytes)
        if found is None:
            return start
        token = self._signer.sign(run, found.group(1).decode("utf-8", "replace"))
        header = (FEEDBACK_TOKEN_HEADER.lower().encode(), token.encode())
        return {**start, "headers": [*start.get("headers", []), header]}

    async def _store_turn(
        self,
        response: _Response,
        payload: dict[str, Any],
        request_messages: list[dict[str, Any]],
        sampling: SamplingParams | None,
        session_id: str | None,
        digest: str,
        traffic: tuple[str, Any] | None,
    ) -> None:
        choice, completion_id = response.parsed()
        if choice is None:
            return
        if sampling is not None:  # a stream's choice has none of its own
            choice.setdefault(CHOICE_KEY, sampling.as_choice_field())
        turn = CapturedTurn(
            request_messages=request_messages,
            tools=payload.get("tools"),
            choice=choice,
            model=payload["model"],
            created_at=time.time(),
            completion_id=completion_id,
            metadata=request_metadata(payload),
        )
        if session_id is not None:
            await self.store.append.remote(session_id, digest, turn)
        if traffic is not None and completion_id is not None:
            run, log = traffic
            try:
                await log.append.remote(StoredTurn(turn=turn, session_id=session_id))
            except Exception as error:  # the log restarts; the client still gets its answer
                logger.warning("a turn of %r was served but not stored in its traffic log: %s", run, error)


def _single_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(token, int) for token in prompt)
    )


def _prompt_messages(prompt: str | list[int]) -> list[dict[str, Any]]:
    """A completion's prompt as the one message of its conversation. It is context only: the trainer
    reads the prompt the engine saw from the choice's `prompt_token_ids`, and a prompt given as token ids
    shows as their JSON."""
    return [{"role": "user", "content": prompt if isinstance(prompt, str) else json.dumps(prompt)}]


def completion_as_chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A `/v1/completions` choice in the chat shape a CapturedTurn holds: its text as the assistant's
    content, its sampled tokens' logprobs as chat's `logprobs.content`, the token data as is."""
    logprobs = choice.get("logprobs") or {}
    content = [
        {"token": token, "logprob": logprob, "bytes": None, "top_logprobs": []}
        for token, logprob in zip(
            logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], strict=False
        )
    ]
    chat = {
        "index": 0,
        "message": {"role": "assistant", "content": choice.get("text") or ""},
        "finish_reason": choice.get("finish_reason") or "stop",
        "logprobs": {"content": content} if content else None,
        "token_ids": choice.get("token_ids") or [],
    }
    for key in ("prompt_token_ids", "policy_version", CHOICE_KEY):
        if choice.get(key) is not None:
            chat[key] = choice[key]
    return chat


class _Response:
    """A completion's body as it streams by; `parsed()` gives its first choice in the non-streaming chat
    shape (a stream's chunks merged, a text completion's choice as chat's) and its id."""

    def __init__(self, stream: bool, chat: bool) -> None:
        self.stream = stream
        self.chat = chat
        self.status = 0
        self._chunks: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)

    def _events(self) -> list[dict[str, Any]]:
        """The response's JSON objects: its body, or each event of a stream."""
        body = b"".join(self._chunks)
        if not self.stream:
            try:
                response = json.loads(body)
            except ValueError:
                return []
            return [response] if isinstance(response, dict) else []
        events = []
        for line in body.decode("utf-8", errors="replace").splitlines():
            data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    events.append(event)
        return events

    def parsed(self) -> tuple[dict[str, Any] | None, str | None]:
        """The response's first choice in the non-streaming chat shape (None when it held none), and its
        `id` (every chunk of a stream carries the same one); the body is parsed once."""
        events = self._events()
        completion_id = next((event["id"] for event in events if isinstance(event.get("id"), str)), None)
        if self.stream:
            return (merge_stream(events) if self.chat else merge_completion_stream(events)), completion_id
        choices = (events[0].get("choices") or []) if events else []
        if not choices:
            return None, completion_id
        return (choices[0] if self.chat else completion_as_chat_choice(choices[0])), completion_id


def _served_step(chunk: dict[str, Any]) -> int | None:
    """The step a stream chunk's `model` (`name@step`) names, if it names one."""
    model = chunk.get("model")
    if not isinstance(model, str):
        return None
    try:
        return parse_versioned_name(model)[1]
    except InvalidModelNameError:
        return None


def merge_stream(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A streamed chat completion's chunks as one non-streaming choice (choice index 0)."""
    content: list[str] = []
    tool_calls: dict[int, dict[str, Any]] = {}
    token_ids: list[int] = []
    logprobs: list[Any] = []
    finish_reason = None
    prompt_token_ids = None
    step = None
    seen = False
    for event in events:
        if prompt_token_ids is None and event.get("prompt_token_ids") is not None:
            prompt_token_ids = event["prompt_token_ids"]
        if step is None:
            step = _served_step(event)
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            seen = True
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                merged = tool_calls.setdefault(
                    call.get("index", 0),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                merged["id"] = call.get("id") or merged["id"]
                function = call.get("function") or {}
                merged["function"]["name"] += function.get("name") or ""
                merged["function"]["arguments"] += function.get("arguments") or ""
            token_ids.extend(choice.get("token_ids") or [])
            logprobs.extend((choice.get("logprobs") or {}).get("content") or [])
            finish_reason = choice.get("finish_reason") or finish_reason
    if not seen:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if tool_calls:
        message["tool_calls"] = [tool_calls[index] for index in sorted(tool_calls)]
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason or "stop",
        "logprobs": {"content": logprobs} if logprobs else None,
        "token_ids": token_ids,
    }
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if step is not None:
        choice["policy_version"] = step
    return choice


def merge_completion_stream(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A streamed text completion's chunks as one choice in the chat shape (choice index 0)."""
    merged: dict[str, Any] = {"text": "", "token_ids": [], "logprobs": {"tokens": [], "token_logprobs": []}}
    seen = False
    for event in events:
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            seen = True
            merged["text"] += choice.get("text") or ""
            merged["token_ids"] += choice.get("token_ids") or []
            logprobs = choice.get("logprobs") or {}
            merged["logprobs"]["tokens"] += logprobs.get("tokens") or []
            merged["logprobs"]["token_logprobs"] += logprobs.get("token_logprobs") or []
            for key in ("prompt_token_ids", "finish_reason"):
                merged[key] = choice.get(key) or merged.get(key)
        if merged.get("policy_version") is None:
            merged["policy_version"] = _served_step(event)
    return completion_as_chat_choice(merged) if seen else None
