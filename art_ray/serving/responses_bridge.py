"""The Responses API (`/v1/responses`) to chat completions and back.

Request: vLLM's `ResponsesRequest` validates it, and vLLM's own helpers turn `instructions` and the input
items (messages, `function_call`, `function_call_output`) into chat messages and the flat function tools
into chat tools. Response: the chat completion's text becomes a `message` item with one `output_text`
part, each tool call a `function_call` item (`call_id` = the chat tool call's id, which the client sends
back in its `function_call_output`). A stream is re-emitted as the Responses events the OpenAI SDK and the
Agents SDK read: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`/`.done`,
`response.function_call_arguments.delta`/`.done`, `response.content_part.done`,
`response.output_item.done`, then `response.completed` (or `response.incomplete` when cut at
`max_output_tokens`) with the whole response.

`previous_response_id`: every response is stored (unless the request says `store: false`) with the input
items it added and its output items, in the cluster's response store (art_ray/serving/response_store.py);
a request that names one is served over the chain's items followed by its own input, so the chat turn
extends the previous one and capture records the chain as one conversation. A response that is not stored
(forgotten, `store: false`, another key's) is a 404, as OpenAI answers it.

Not supported (a 400 that says so): `conversation` (server-side conversation objects), `background`,
and tools other than functions (web search, file search, MCP, ...).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import pydantic

from art_ray.serving.protocol_bridge import BridgeRequestError, sampling_extras, sse, validation_message

TEXT_PART_TYPES = ("input_text", "output_text", "text")
# the request's settings a response echoes back
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "temperature", "top_p")


def _chat_content(content: Any) -> Any:
    """A message's content with the Responses text parts as chat's: all text, one string."""
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES for part in content
    ):
        return "".join(str(part.get("text", "")) for part in content)
    return content


def _chat_tool_choice(tool_choice: Any) -> Any:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        return {"type": "function", "function": {"name": tool_choice.get("name")}}
    if isinstance(tool_choice, str):
        return tool_choice
    raise BridgeRequestError(
        400, f"unsupported tool_choice {tool_choice!r}: use auto, none, required or a function"
    )


class ResponseHistory(Protocol):
    """Stored responses (art_ray/serving/response_store.py), bound to the key that asked for them."""

    async def put(
        self, response_id: str, owner: str, previous_id: str | None, items: list[dict[str, Any]]
    ) -> None: ...

    async def conversation(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The items of the chain ending at `response_id`, oldest first (None: not stored for `owner`)."""
        ...


def _input_items(request_input: Any) -> Any:
    """The request's `input` as items (a string is one user message); anything else as it came, for the
    request's validation to refuse."""
    if isinstance(request_input, str):
        return [{"role": "user", "content": request_input}]
    return request_input


class ResponsesBridge:
    def __init__(self, history: ResponseHistory) -> None:
        self._history = history

    async def chat_request(self, payload: dict[str, Any], caller: str) -> dict[str, Any]:
        previous_id = payload.get("previous_response_id")
        if previous_id is not None:
            earlier = await self._history.conversation(str(previous_id), caller)
            if earlier is None:
                raise BridgeRequestError(
                    404, f"Response with id '{previous_id}' not found.", "previous_response_id"
                )
            new_items = _input_items(payload.get("input"))
            if isinstance(new_items, list):
                payload = {**payload, "input": earlier + new_items}
        return self._chat_request(payload)

    def _chat_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

        if payload.get("conversation"):
            raise BridgeRequestError(
                400,
                "`conversation` is not supported: continue with `previous_response_id`, or send the whole "
                "conversation as `input`",
                "conversation",
            )
        if payload.get("background"):
            raise BridgeRequestError(400, "`background` responses are not supported", "background")
        for tool in payload.get("tools") or []:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else tool
                raise BridgeRequestError(400, f"only function tools are supported, not {kind!r}", "tools")
        try:
            request = ResponsesRequest.model_validate(payload)
            messages = construct_input_messages(
                request_instructions=request.instructions, request_input=request.input
            )
        except pydantic.ValidationError as error:
            raise BridgeRequestError(400, validation_message(error), "input") from None
        except ValueError as error:  # vLLM's VLLMValidationError: an input item it cannot read
            raise BridgeRequestError(400, str(error), "input") from None
        except (AttributeError, IndexError, KeyError, TypeError) as error:
            # vLLM's conversion assumes shapes the schema allows otherwise (an assistant message whose
            # first part is a refusal, or that has no parts, was a 500): the client's input, so a 400
            kind = type(error).__name__
            message = f"an input item this endpoint cannot convert to chat messages ({kind}: {error})"
            raise BridgeRequestError(400, message, "input") from None
        chat: dict[str, Any] = {
            "model": request.model,
            "messages": [
                {**message, "content": _chat_content(message["content"])} if "content" in message else message
                for message in messages
            ],
        }
        if request.tools:
            chat["tools"] = construct_tool_dicts(request.tools, request.tool_choice)
            chat["tool_choice"] = _chat_tool_choice(payload.get("tool_choice", "auto"))
            chat["parallel_tool_calls"] = request.parallel_tool_calls
        for responses_name, chat_name in (
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
        ):
            if payload.get(responses_name) is not None:
                chat[chat_name] = payload[responses_name]
        chat.update(sampling_extras(payload))
        if payload.get("store") is False:  # not stored for training either (art_ray/serving/capture.py)
            chat["store"] = False
        if payload.get("metadata") is not None:  # a stored turn keeps it; its `task` groups the turn
            chat["metadata"] = payload["metadata"]
        for sticky in ("user", "safety_identifier"):  # a release's arm follows the user
            if payload.get(sticky) is not None:
                chat[sticky] = payload[sticky]
        text_format = (payload.get("text") or {}).get("format") or {}
        if text_format.get("type") == "json_schema":
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    key: text_format[key] for key in ("name", "schema", "strict") if key in text_format
                },
            }
        elif text_format.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        if payload.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

    async def response(self, chat: dict[str, Any], payload: dict[str, Any], caller: str) -> dict[str, Any]:
        (choice, *_) = chat.get("choices") or [{}]
        message = choice.get("message") or {}
        output: list[dict[str, Any]] = []
        if message.get("content") or not message.get("tool_calls"):
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            output.append(_message_item(_item_id("msg"), message.get("content") or "", logprobs, payload))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            output.append(
                _function_call_item(
                    _item_id("fc"), call.get("id"), function.get("name"), function.get("arguments")
                )
            )
        response = _response(chat, payload, output, choice.get("finish_reason"), chat.get("usage"))
        await self._store(response, payload, caller)
        return response

    async def _store(self, response: dict[str, Any], payload: dict[str, Any], caller: str) -> None:
        """Keep the response for a request that continues it (`previous_response_id`): the items this
        request added, then the output."""
        if payload.get("store") is False:
            return
        items = _input_items(payload.get("input"))
        await self._history.put(
            response["id"], caller, payload.get("previous_response_id"), [*items, *response["output"]]
        )

    async def stream(
        self, chunks: AsyncIterator[str], payload: dict[str, Any], caller: str
    ) -> AsyncIterator[str]:
        events = _ResponseEvents(payload)
        async for item in chunks:
            data = item.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if isinstance(chunk.get("error"), dict):  # vLLM's error inside a started stream
                error = chunk["error"]
                yield events.error(str(error.get("message", "")), error.get("param"))
                return
            for event in events.chunk(chunk):
                yield event
        if events.first is None:  # no chunk at all: the chat route ended without a completion
            yield events.error("the completion ended without output")
            return
        for event in events.close_items():
            yield event
        response = events.response()
        await self._store(response, payload, caller)
        yield events.done(response)

    def error(self, status: int, message: str, error_type: str, param: str | None) -> dict[str, Any]:
        return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _wants_logprobs(payload: dict[str, Any]) -> bool:
    return "message.output_text.logprobs" in (payload.get("include") or [])


def _output_logprobs(logprobs: list[dict[str, Any]], payload: dict[str, Any]) -> list[dict[str, Any]]:
    if not _wants_logprobs(payload):
        return []
    return [
        {
            "token": entry.get("token", ""),
            "logprob": entry.get("logprob", 0.0),
            "bytes": entry.get("bytes") or [],
            "top_logprobs": entry.get("top_logprobs") or [],
        }
        for entry in logprobs
    ]


def _text_part(text: str, logprobs: list[dict[str, Any]], payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": _output_logprobs(logprobs, payload),
    }


def _message_item(
    item_id: str,
    text: str,
    logprobs: list[dict[str, Any]],
    payload: dict[str, Any],
    status: str = "completed",
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [_text_part(text, logprobs, payload)],
    }


def _function_call_item(
    item_id: str, call_id: str | None, name: str | None, arguments: str | None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id or _item_id("call"),
        "name": name or "",
        "arguments": arguments or "",
        "status": status,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _response(
    chat: dict[str, Any],
    payload: dict[str, Any],
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    status: str | None = None,
) -> dict[str, Any]:
    incomplete = finish_reason == "length"
    response: dict[str, Any] = {
        "id": "resp_" + str(chat.get("id") or uuid.uuid4().hex).removeprefix("chatcmpl-"),
        "object": "response",
        "created_at": chat.get("created") or int(time.time()),
        "model": chat.get("model") or payload.get("model"),
        "status": status or ("incomplete" if incomplete else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status is None else None,
        "error": None,
        "output": output,
        "tools": payload.get("tools") or [],
        "tool_choice": payload.get("tool_choice") or "auto",
        "text": payload.get("text") or {"format": {"type": "text"}},
        "previous_response_id": payload.get("previous_response_id"),
        "store": payload.get("store") is not False,
        "usage": _usage(usage),
    }
    for key in ECHOED:
        response[key] = payload.get(key)
    response["parallel_tool_calls"] = payload.get("parallel_tool_calls", True)
    response["metadata"] = payload.get("metadata") or {}
    return response


class _ResponseEvents:
    """A chat completion's stream, chunk by chunk, as Responses events."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload
        self.sequence = 0
        self.first: dict[str, Any] | None = None
        self.output: list[dict[str, Any]] = []  # items done, in order
        self.text: dict[str, Any] | None = None  # the message item being written
        self.text_logprobs: list[dict[str, Any]] = []
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its open function_call item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(kind, event)

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if self.first is None:
            self.first = chunk
            started = _response(chunk, self.payload, [], None, None, status="in_progress")
            events += [
                self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
            ]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text_delta(
                    delta["content"], (choice.get("logprobs") or {}).get("content") or []
                )
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> list[str]:
        events = []
        if self.text is None:
            self.text = _message_item(_item_id("msg"), "", [], self.payload, status="in_progress")
            self.text["output_index"] = len(self.output) + len(self.calls)
            item = {key: value for key, value in self.text.items() if key != "output_index"}
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=self.text["output_index"],
                    item={**item, "content": []},
                ),
                self._event(
                    "response.content_part.added",
                    item_id=self.text["id"],
                    output_index=self.text["output_index"],
                    content_index=0,
                    part=_text_part("", [], self.payload),
                ),
            ]
        self.text["content"][0]["text"] += text
        self.text_logprobs += logprobs
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.text["id"],
                output_index=self.text["output_index"],
                content_index=0,
                delta=text,
                logprobs=_output_logprobs(logprobs, self.payload),
            )
        )
        return events

    def _close_text(self) -> list[str]:
        if self.text is None:
            return []
        text, self.text = self.text, None
        index = text.pop("output_index")
        part = _text_part(text["content"][0]["text"], self.text_logprobs, self.payload)
        text.update(status="completed", content=[part])
        self.output.append(text)
        return [
            self._event(
                "response.output_text.done",
                item_id=text["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            ),
            self._event(
                "response.content_part.done",
                item_id=text["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=index, item=text),
        ]

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        events = []
        function = call.get("function") or {}
        index = call.get("index", 0)
        item = self.calls.get(index)
        if item is None:
            events += self._close_text()
            item = _function_call_item(
                _item_id("fc"), call.get("id"), function.get("name"), "", status="in_progress"
            )
            item["output_index"] = len(self.output) + len(self.calls)
            self.calls[index] = item
            added = {key: value for key, value in item.items() if key != "output_index"}
            events.append(
                self._event("response.output_item.added", output_index=item["output_index"], item=added)
            )
        elif function.get("name"):
            item["name"] += function["name"]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=item["output_index"],
                    delta=function["arguments"],
                )
            )
        return events

    def error(self, message: str, param: str | None = None) -> str:
        return self._event("error", code="server_error", message=message, param=param)

    def close_items(self) -> list[str]:
        """The events that finish the items still open."""
        events = self._close_text()
        for index in sorted(self.calls):
            item = self.calls[index]
            output_index = item.pop("output_index")
            item["status"] = "completed"
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=output_index,
                    name=item["name"],
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=output_index, item=item),
            ]
            self.output.append(item)
        self.calls = {}
        return events

    def response(self) -> dict[str, Any]:
        """The whole response, once the stream ended and its items are closed."""
        assert self.first is not None
        return _response(self.first, self.payload, self.output, self.finish_reason, self.usage)

    def done(self, response: dict[str, Any]) -> str:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)
