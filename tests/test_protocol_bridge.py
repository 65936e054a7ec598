"""The Responses and Messages bridges' translations (vLLM's converters, the SDKs' own types as the judge)
and the bridge middleware around a stand-in chat route; the real endpoint is tests/test_protocols.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic.types
import openai.types.responses
import pydantic
import pytest

from art_ray.access import AccessTable, KeyGrant, key_digest
from art_ray.serving.endpoint_guard import EndpointGuard
from art_ray.serving.messages_bridge import MessagesBridge
from art_ray.serving.protocol_bridge import BridgeRequestError, ProtocolBridge
from art_ray.serving.response_store import StoredResponses
from art_ray.serving.responses_bridge import ResponsesBridge

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}
CHAT_ID = "chatcmpl-abc"


def chat_completion(
    content: str | None, calls: list[tuple[str, str, str]] = (), finish: str = "stop"
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}
            for id_, name, arguments in calls
        ]
    return {
        "id": CHAT_ID,
        "object": "chat.completion",
        "created": 1700000000,
        "model": "agent@3",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": {
                    "content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
                },
                "token_ids": [1, 2],
                "policy_version": 3,
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
    }


def chat_chunks(pieces: list[dict], finish: str) -> list[str]:
    """A chat stream's `data:` items: a role chunk, one chunk per delta, the finish, the usage, [DONE]."""
    base = {"id": CHAT_ID, "object": "chat.completion.chunk", "created": 1700000000, "model": "agent@3"}
    deltas = [{"role": "assistant", "content": ""}, *pieces]
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append(
        {**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    )
    return [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]


async def collect(events) -> list[str]:  # noqa: ANN001
    return [event async for event in events]


async def items(chunks: list[str]):  # noqa: ANN201
    for chunk in chunks:
        yield chunk


def sse_data(events: list[str]) -> list[dict]:
    return [
        json.loads(line.removeprefix("data:"))
        for e in events
        for line in e.splitlines()
        if line.startswith("data:")
    ]


# --- Responses ----------------------------------------------------------------------------------------


class MemoryHistory:
    """The response store's own logic in this process (a replica reaches it as a Ray actor)."""

    def __init__(self, max_bytes: int = 2**20) -> None:
        self.store = StoredResponses(max_bytes)

    async def put(self, response_id: str, owner: str, previous_id: str | None, items: list[dict]) -> None:
        self.store.put(response_id, owner, previous_id, items)

    async def conversation(self, response_id: str, owner: str) -> list[dict] | None:
        return self.store.conversation(response_id, owner)


def responses_bridge(history: MemoryHistory | None = None) -> ResponsesBridge:
    return ResponsesBridge(history or MemoryHistory())


def test_responses_input_items_become_the_chat_conversation() -> None:
    chat = asyncio.run(
        responses_bridge().chat_request(
            {
                "model": "agent",
                "instructions": "Be brief.",
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is "},
                            {"type": "input_text", "text": "x?"},
                        ],
                    },
                    {
                        "type": "function_call",
                        "call_id": "call_1",
                        "name": "lookup",
                        "arguments": '{"word": "x"}',
                    },
                    {"type": "function_call_output", "call_id": "call_1", "output": "a letter"},
                ],
                "tools": [TOOL],
                "tool_choice": {"type": "function", "name": "lookup"},
                "max_output_tokens": 16,
                "temperature": 0.5,
                "stream": True,
                "ignore_eos": True,  # vLLM's sampling settings pass through, as on its chat route
            },
            "",
        )
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is x?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"word": "x"}'},
                }
            ],
        },
        {"role": "tool", "content": "a letter", "tool_call_id": "call_1"},
    ]
    assert chat["tools"][0]["function"]["name"] == "lookup"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert (chat["max_tokens"], chat["temperature"], chat["stream"]) == (16, 0.5, True)
    assert chat["stream_options"] == {"include_usage": True} and chat["ignore_eos"] is True
    assert "logprobs" not in chat  # the chat route's own defaults (token ids, logprobs) apply


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"model": "m", "input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"model": "m", "input": [{"type": "no_such_item"}]}, "input"),
        ({"model": "m", "input": "hi", "background": True}, "background"),
    ],
)
def test_responses_requests_it_cannot_serve_are_400_that_say_why(payload: dict, says: str) -> None:
    with pytest.raises(BridgeRequestError, match=says) as raised:
        asyncio.run(responses_bridge().chat_request(payload, ""))
    assert raised.value.status == 400


def test_a_chat_completion_becomes_a_response_the_openai_sdk_reads() -> None:
    payload = {"model": "agent", "input": "hi", "tools": [TOOL], "include": ["message.output_text.logprobs"]}
    body = asyncio.run(
        responses_bridge().response(
            chat_completion("Hi", [("call_9", "lookup", '{"word": "hi"}')]), payload, ""
        )
    )
    response = openai.types.responses.Response.model_validate(body)
    assert response.model == "agent@3" and response.status == "completed"
    assert response.output_text == "Hi"
    message, call = response.output
    assert message.content[0].logprobs[0].logprob == -0.5
    assert (call.type, call.call_id, call.name, call.arguments) == (
        "function_call",
        "call_9",
        "lookup",
        '{"word": "hi"}',
    )
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 2)
    cut = asyncio.run(
        responses_bridge().response(
            chat_completion("Hi", finish="length"), {"model": "agent", "input": "hi"}, ""
        )
    )
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_chat_stream_becomes_the_responses_events_the_openai_sdk_reads() -> None:
    chunks = chat_chunks(
        [
            {"content": "Let me "},
            {"content": "look."},
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": ""},
                    }
                ]
            },
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"word": '}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]},
        ],
        finish="tool_calls",
    )
    payload = {"model": "agent", "input": "hi", "tools": [TOOL], "stream": True}
    events = sse_data(asyncio.run(collect(responses_bridge().stream(items(chunks), payload, ""))))
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    parsed = [adapter.validate_python(event) for event in events]
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    kinds = [event.type for event in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    text = "".join(event.delta for event in parsed if event.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in parsed if e.type == "response.function_call_arguments.delta")
    assert (text, arguments) == ("Let me look.", '{"word": "x"}')
    final = parsed[-1].response
    assert final.output_text == "Let me look."
    assert [(item.type, getattr(item, "call_id", None)) for item in final.output] == [
        ("message", None),
        ("function_call", "call_7"),
    ]
    done = [event.item for event in parsed if event.type == "response.output_item.done"]
    assert [item.model_dump() for item in done] == [item.model_dump() for item in final.output]
    assert final.usage.output_tokens == 3


# --- Anthropic Messages -----------------------------------------------------------------------------------


def messages_bridge() -> MessagesBridge:
    """vLLM's converters on a handler with no engine: they use none of its state but this flag."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    handler = AnthropicServingMessages.__new__(AnthropicServingMessages)
    handler._merge_inline_system = False
    return MessagesBridge(handler)


def test_a_messages_conversation_with_tools_becomes_chat() -> None:
    chat = asyncio.run(
        messages_bridge().chat_request(
            {
                "model": "agent",
                "max_tokens": 32,
                "system": "Be brief.",
                "messages": [
                    {"role": "user", "content": "Look up x."},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "x"}}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a letter"}],
                    },
                ],
                "tools": [
                    {"name": "lookup", "description": "Look a word up.", "input_schema": TOOL["parameters"]}
                ],
                "tool_choice": {"type": "any"},
                "ignore_eos": True,
            },
            "",
        )
    )
    roles = [message["role"] for message in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    assert json.loads(chat["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"word": "x"}
    assert chat["tool_choice"] == "required" and chat["max_tokens"] == 32 and chat["ignore_eos"] is True
    assert "logprobs" not in chat and "stream" not in chat


def test_messages_requests_are_validated_by_vllms_model() -> None:
    with pytest.raises(BridgeRequestError, match="max_tokens") as raised:
        asyncio.run(
            messages_bridge().chat_request(
                {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}, ""
            )
        )
    assert raised.value.status == 400


def test_a_chat_completion_becomes_a_message_the_anthropic_sdk_reads() -> None:
    body = asyncio.run(
        messages_bridge().response(
            chat_completion("Hi", [("call_9", "lookup", '{"word": "hi"}')], "tool_calls"), {}, ""
        )
    )
    message = anthropic.types.Message.model_validate(body)
    assert message.model == "agent@3" and message.stop_reason == "tool_use"
    text, tool = message.content
    assert text.text == "Hi" and (tool.name, tool.input) == ("lookup", {"word": "hi"})
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 2)


def test_a_chat_stream_becomes_the_messages_events_the_anthropic_sdk_reads() -> None:
    chunks = chat_chunks([{"content": "Hel"}, {"content": "lo"}], finish="stop")
    events = sse_data(asyncio.run(collect(messages_bridge().stream(items(chunks), {}, ""))))
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    parsed = [adapter.validate_python(event) for event in events]
    assert parsed[0].type == "message_start" and parsed[-1].type == "message_stop"
    assert "".join(e.delta.text for e in parsed if e.type == "content_block_delta") == "Hello"
    (stop,) = [event for event in parsed if event.type == "message_delta"]
    assert stop.delta.stop_reason == "end_turn"


# --- the middleware, around a stand-in chat route ------------------------------------------------------


class ChatRoute:
    """What the bridge sends on: records the request, answers `answer` (status, JSON or SSE items)."""

    def __init__(self, status: int, answer: dict | list[str]) -> None:
        self.status, self.answer = status, answer
        self.scope: dict | None = None
        self.body: dict | None = None

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        self.scope, self.body = scope, json.loads((await receive())["body"])
        stream = isinstance(self.answer, list)
        content_type = b"text/event-stream" if stream else b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [(b"content-type", content_type)],
            }
        )
        for item in self.answer if stream else [json.dumps(self.answer)]:
            await send({"type": "http.response.body", "body": item.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def call(app, path: str, payload: Any, key: str = "") -> tuple[int, bytes]:  # noqa: ANN001
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "root_path": "",
        "headers": [(b"content-length", b"1"), (b"authorization", f"Bearer {key}".encode())],
    }
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_bridge_sends_a_session_scoped_request_on_as_chat_and_answers_in_the_clients_protocol() -> None:
    route = ChatRoute(200, chat_completion("Hi"))
    app = ProtocolBridge(route, {"/v1/responses": responses_bridge()})
    status, body = call(app, "/sessions/s0123456789abcdef/v1/responses", {"model": "agent", "input": "hi"})
    assert status == 200 and json.loads(body)["output"][0]["content"][0]["text"] == "Hi"
    assert route.scope["path"] == "/sessions/s0123456789abcdef/v1/chat/completions"
    assert dict(route.scope["headers"])[b"content-length"] == str(len(json.dumps(route.body))).encode()
    assert route.body["messages"] == [{"role": "user", "content": "hi"}]


def test_chat_route_errors_reach_each_client_in_its_own_shape() -> None:
    not_found = {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    messages = ProtocolBridge(ChatRoute(404, not_found), {"/v1/messages": messages_bridge()})
    status, body = call(
        messages,
        "/v1/messages",
        {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 404
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `x` does not exist."},
    }
    responses = ProtocolBridge(ChatRoute(404, not_found), {"/v1/responses": responses_bridge()})
    status, body = call(responses, "/v1/responses", {"model": "x", "input": "hi", "stream": True})
    assert status == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    status, body = call(messages, "/v1/messages", ["not", "an", "object"])
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_stream_goes_out_as_the_protocols_events() -> None:
    chunks = chat_chunks([{"content": "Hel"}, {"content": "lo"}], finish="stop")
    app = ProtocolBridge(ChatRoute(200, chunks), {"/v1/responses": responses_bridge()})
    status, body = call(app, "/v1/responses", {"model": "agent", "input": "hi", "stream": True})
    events = sse_data([body.decode()])
    assert status == 200 and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"


def test_previous_response_id_continues_the_stored_conversation_for_the_same_key_only() -> None:
    route = ChatRoute(200, chat_completion(None, [("call_1", "lookup", '{"word": "x"}')], "tool_calls"))
    # alice's and bob's run keys: what the endpoint's gate puts in the scope binds the stored responses
    access = AccessTable()
    for name in ("alice", "bob"):
        access = access.with_key(key_digest(name), KeyGrant(name=name))
    app = EndpointGuard(ProtocolBridge(route, {"/v1/responses": responses_bridge()}), None, lambda: access)
    first_request = {"model": "agent", "instructions": "Be brief.", "input": "Look up x.", "tools": [TOOL]}
    status, body = call(app, "/v1/responses", first_request, key="alice")
    first = json.loads(body)
    assert status == 200 and first["store"] is True and first["previous_response_id"] is None
    # each chat completion has its own id, and so each response
    route.answer = [
        chunk.replace(CHAT_ID, "chatcmpl-2") for chunk in chat_chunks([{"content": "A letter."}], "stop")
    ]
    output = {"type": "function_call_output", "call_id": "call_1", "output": "a letter"}
    chained = {"model": "agent", "input": [output], "previous_response_id": first["id"], "stream": True}
    status, body = call(app, "/v1/responses", chained, key="alice")
    streamed = sse_data([body.decode()])[-1]["response"]
    assert status == 200 and streamed["previous_response_id"] == first["id"]
    # the chain is one conversation, the instructions are each request's own (OpenAI's semantics)
    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"word": "x"}'},
    }
    assert route.body["messages"] == [
        {"role": "user", "content": "Look up x."},
        {"role": "assistant", "tool_calls": [tool_call]},
        {"role": "tool", "content": "a letter", "tool_call_id": "call_1"},
    ]
    route.answer = {**chat_completion("Bye."), "id": "chatcmpl-3"}
    status, _ = call(app, "/v1/responses", {**chained, "input": "Thanks.", "stream": False}, key="bob")
    assert status == 404  # another key's response does not exist for it
    # a streamed response is stored too: a third turn sees all of them
    thanks = {"model": "agent", "input": "Thanks.", "previous_response_id": streamed["id"], "store": False}
    status, body = call(app, "/v1/responses", thanks, key="alice")
    assert status == 200 and json.loads(body)["store"] is False
    assert [m["role"] for m in route.body["messages"]] == ["user", "assistant", "tool", "assistant", "user"]
    assert route.body["messages"][3]["content"] == "A letter."
    status, body = call(
        app, "/v1/responses", {**thanks, "previous_response_id": json.loads(body)["id"]}, "alice"
    )
    error = json.loads(body)["error"]
    assert status == 404 and error["type"] == "NotFoundError" and error["param"] == "previous_response_id"


def test_the_response_store_forgets_the_least_recently_used_past_its_bytes() -> None:
    item = [{"type": "message", "role": "user", "content": "x" * 100}]
    store = StoredResponses(max_bytes=3 * len(json.dumps(item)))
    for response_id in ("a", "b", "c"):
        store.put(response_id, "k", None, item)
    assert store.conversation("a", "k") == item  # used: now the most recent
    store.put("d", "k", "c", item)
    assert store.conversation("b", "k") is None and store.stats()["responses"] == 3
    assert store.conversation("d", "k") == item + item and store.conversation("d", "other") is None
    assert not store.put("huge", "k", None, item * 4)
