"""ASGI middleware in front of vLLM's routes: ART model names, and token data on every choice.

- `name` means the latest version `name@step` this replica serves, or, for a run with a release
  (art_ray/releases.py), the step its arm gives the request's user; `name@step` is fetched from the
  registry first if it was published but is not loaded here yet (vLLM answers 404 for a version nobody
  has). An invalid name is a 400; the base model is unlisted, and a 404 for run keys.
- A generation request that names no `max_tokens` gets the app's `default_max_tokens`.
- Generation requests default to `logprobs` and `return_token_ids`, so every choice carries its
  sampled token ids and logprobs (of the distribution it was sampled from, after temperature); non-streaming
  choices also get `policy_version` (the step that sampled them), `sampling_params` (temperature, top_p,
  top_k, seed, max_tokens: art_ray/sampling.py) and, in chat, the response's `prompt_token_ids`, so a
  Choice appended to a Trajectory alone holds what the trainer needs.
- `/v1/models` lists the loaded versions plus one alias per model for its latest version.
- A run key sees its own runs only (art_ray/access.py): another run's name is answered as an unknown one,
  and `/v1/models` lists only what the caller sees.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from typing import Protocol

from art_ray.adapters.spec import InvalidModelNameError, parse_versioned_name, versioned_name
from art_ray.sampling import CHOICE_KEY, DEFAULT_TEMPERATURE, SamplingParams
from art_ray.serving.asgi import (
    Caller,
    Message,
    Receive,
    Scope,
    Send,
    caller_of,
    read_body,
    replay,
    send_error,
    unknown_model,
    with_content_length,
)
from art_ray.serving.endpoint_guard import CHAT_PATH, COMPLETIONS_PATH, MODELS_PATH, request_path
from art_ray.serving.vllm_app import BASE_MODEL_NAME


class VersionLookup(Protocol):
    def latest_step(self, model: str) -> int | None: ...

    def served_models(self) -> dict[str, list[int]]: ...

    async def ensure(self, model: str, step: int) -> bool:
        """Whether `model@step` is served, fetched first from the registry if it was published."""
        ...


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, error_type: str, param: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.param = param


class ModelRoutingMiddleware:
    def __init__(self, app: Callable, versions: VersionLookup, max_n: int, default_max_tokens: int) -> None:
        self.app = app
        self.versions = versions
        self.max_n = max_n
        self.default_max_tokens = default_max_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = request_path(scope)
        method = scope["method"]
        if method == "POST" and path in (CHAT_PATH, COMPLETIONS_PATH):
            await self._generation(scope, receive, send, chat=path == CHAT_PATH)
        elif method == "GET" and path == MODELS_PATH:
            caller = caller_of(scope)
            await self.app(
                scope, receive, _rewrite_json(send, lambda listing: self._rewrite_model_list(listing, caller))
            )
        else:
            await self.app(scope, receive, send)

    async def _generation(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        body = await read_body(receive)
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            # answered here: a body that is not UTF-8 got FastAPI's {"detail": ...}, not OpenAI's error JSON
            await send_error(send, 400, "the request body must be a JSON object", "BadRequestError")
            return
        try:
            await self._rewrite_request(payload, chat, caller_of(scope))
        except RequestRejected as rejected:
            await send_error(send, rejected.status, str(rejected), rejected.error_type, rejected.param)
            return
        new_body = json.dumps(payload).encode()
        scope = {**scope, "headers": with_content_length(scope["headers"], len(new_body))}
        if not payload.get("stream"):
            _, step = parse_versioned_name(payload["model"])
            sampling = SamplingParams.of_request(payload)
            send = _rewrite_json(send, lambda response: _annotate_choices(response, step, sampling))
        await self.app(scope, replay(new_body, receive), send)

    async def _rewrite_request(self, payload: dict, chat: bool, caller: Caller) -> None:
        n = payload.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.max_n):
            message = f"`n` must be an integer from 1 to {self.max_n}"
            raise RequestRejected(400, message, "BadRequestError", "n")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            message = "`model` is required: name the model as `name` or `name@step`"
            raise RequestRejected(400, message, "BadRequestError", "model")
        if model == BASE_MODEL_NAME:
            # unlisted, but the admin key may sample the base model itself (the Tinker API's base-model
            # sampling clients); to a run key it does not exist
            if caller.grant is not None:
                raise RequestRejected(404, unknown_model(model), "NotFoundError", "model")
        else:
            await self._route_version(payload, model, caller)
        if payload.get("max_tokens") is None and payload.get("max_completion_tokens") is None:
            payload["max_tokens"] = self.default_max_tokens
        payload.pop("store", None)  # capture's (art_ray/serving/capture.py); vLLM has no such field
        if payload.get("temperature") is None:  # said, so that the recorded temperature is the one used
            payload["temperature"] = DEFAULT_TEMPERATURE
        payload.setdefault("return_token_ids", True)
        if chat:
            if payload.get("logprobs") is None:
                payload["logprobs"] = True
        elif payload.get("logprobs") is None:
            payload["logprobs"] = 0

    async def _route_version(self, payload: dict, model: str, caller: Caller) -> None:
        """`name` to its latest served `name@step`; `name@step` fetched first if published elsewhere."""
        try:
            name, step = parse_versioned_name(model)
        except InvalidModelNameError as error:
            raise RequestRejected(400, str(error), "BadRequestError", "model") from None
        if not caller.sees(name):
            raise RequestRejected(404, unknown_model(model), "NotFoundError", "model")
        if step is None:
            release = caller.access.releases.get(name)
            chosen = release.arm_for(sticky_id(payload), random.random()) if release is not None else None
            if chosen is not None and await self.versions.ensure(name, chosen):
                payload["model"] = versioned_name(name, chosen)
                return
            latest = self.versions.latest_step(name)
            if release is not None and latest in release.rejected:  # a rolled-back step is never `name`
                kept = [s for s in self.versions.served_models().get(name, []) if s not in release.rejected]
                latest = max(kept, default=latest)
            if latest is None:
                raise RequestRejected(404, unknown_model(model), "NotFoundError", "model")
            payload["model"] = versioned_name(name, latest)
        else:
            await self.versions.ensure(name, step)  # if not: vLLM answers 404 for a version nobody has

    def _rewrite_model_list(self, listing: dict, caller: Caller) -> dict:
        cards = [
            card
            for card in listing.get("data", [])
            if card.get("id") != BASE_MODEL_NAME and caller.sees(_card_model(card))
        ]
        for name, steps in sorted(self.versions.served_models().items()):
            if steps and caller.sees(name):
                latest = next((c for c in cards if c.get("id") == versioned_name(name, max(steps))), None)
                if latest is not None:
                    cards.append({**latest, "id": name})
        listing["data"] = cards
        return listing


def sticky_id(payload: dict) -> str | None:
    """Who sent a request, for a release's sticky arm (art_ray/releases.py): OpenAI's `user` or
    `safety_identifier` (the Responses bridge passes them on, the Messages bridge Anthropic's
    `metadata.user_id` as `user`), else the request's `metadata["user_id"]`; None: anonymous, an arm per
    request."""
    for value in (payload.get("user"), payload.get("safety_identifier")):
        if isinstance(value, str) and value:
            return value
    metadata = payload.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user if isinstance(user, str) and user else None


def _card_model(card: dict) -> str:
    """The run a `/v1/models` card (`name@step`) belongs to."""
    try:
        return parse_versioned_name(str(card.get("id")))[0]
    except InvalidModelNameError:
        return str(card.get("id"))


def _annotate_choices(response: dict, step: int | None, sampling: SamplingParams | None) -> dict:
    """Each choice carries what a Trajectory needs of it alone: the response's `prompt_token_ids` (chat),
    `policy_version`, the trained step that sampled it, and the `sampling_params` it was drawn with."""
    prompt_token_ids = response.get("prompt_token_ids")
    for choice in response.get("choices", []):
        if prompt_token_ids is not None:
            choice.setdefault("prompt_token_ids", prompt_token_ids)
        if step is not None:
            choice["policy_version"] = step
        if sampling is not None:
            choice[CHOICE_KEY] = sampling.as_choice_field()
    return response


def _rewrite_json(send: Send, rewrite: Callable[[dict], dict]) -> Send:
    """Buffer a successful JSON response and pass it through `rewrite`; anything else is untouched."""
    start: Message | None = None
    chunks: list[bytes] = []

    async def wrapped(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if message["status"] == 200 and content_type.startswith(b"application/json"):
                start = message
                return
            await send(message)
        elif message["type"] == "http.response.body" and start is not None:
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            with contextlib.suppress(ValueError):
                parsed = json.loads(body)
                # vLLM answers a request whose client went away with a JSON `null` (with_cancellation):
                # nothing to rewrite (found by the soak's flood: an AttributeError per cancelled request)
                if isinstance(parsed, dict):
                    body = json.dumps(rewrite(parsed)).encode()
            await send({**start, "headers": with_content_length(start.get("headers", []), len(body))})
            await send({"type": "http.response.body", "body": body})
        else:
            await send(message)

    return wrapped
