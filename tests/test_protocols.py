"""The Responses API and Anthropic Messages on the session app (2 replicas of `tiny`), with the real
clients unchanged but for URL and key: each reply is served and recorded as the chat turn the engine
sampled, and bad input gets each protocol's own error. Training on such turns: tests/test_sdk.py."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pytest

from art_ray import Model, SamplingParams, sampled_tokens

pytestmark = pytest.mark.slow

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up in the dictionary.",
    "parameters": {
        "type": "object",
        # an enum: the tiny model's call always ends well within its max tokens
        "properties": {"word": {"type": "string", "enum": ["red", "blue", "green"]}},
        "required": ["word"],
        "additionalProperties": False,
    },
}
ANTHROPIC_TOOL = {
    "name": TOOL["name"],
    "description": TOOL["description"],
    "input_schema": TOOL["parameters"],
}


def model_of(app) -> Model:  # noqa: ANN001
    return Model(name=app.model, project="protocols", base_url=app.base_url, api_key=app.api_key)


def anthropic_client(base_url: str, api_key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)


async def test_openai_responses_plain_streamed_and_with_a_tool_are_recorded_as_sampled(inference_app) -> None:
    model = model_of(inference_app)
    async with model.capture() as session:
        client = session.openai_client(max_retries=0)
        # every turn sends the tools, as agents do: a turn with other tools starts another conversation
        first = await client.responses.create(
            model=model.name,
            input="Name a color.",
            tools=[TOOL],
            tool_choice="none",
            max_output_tokens=6,
            temperature=1.0,
        )
        conversation: list = [{"role": "user", "content": "Name a color."}, *first.output]
        conversation.append({"role": "user", "content": "Look it up."})
        called = await client.responses.create(
            model=model.name,
            input=conversation,
            tools=[TOOL],
            tool_choice="required",
            parallel_tool_calls=False,  # one call: the tiny model would go on writing calls to the limit
            max_output_tokens=80,
            temperature=1.0,
        )
        (call,) = [item for item in called.output if item.type == "function_call"]
        conversation += [
            *called.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "a hue"},
        ]
        stream = await client.responses.create(
            model=model.name,
            input=conversation,
            tools=[TOOL],
            max_output_tokens=6,
            temperature=0.8,
            stream=True,
        )
        events = [event async for event in stream]
        trajectory = await session.trajectory(reward=1.0)
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert first.model == final.model == f"{model.name}@0"  # the step that sampled them
    # one conversation: the tool's result is context, each reply a choice with the engine's tokens
    choices = trajectory.trainable_choices()
    assert not trajectory.additional_histories and len(choices) == 3
    assert choices[0].message.content == first.output_text
    assert json.loads(choices[1].message.tool_calls[0].function.arguments) == json.loads(call.arguments)
    assert choices[2].message.content == final.output_text
    assert [m for m in trajectory.messages() if m["role"] == "tool"][0]["content"] == "a hue"
    assert trajectory.tools[0]["function"]["name"] == "lookup"
    assert all(len(sampled_tokens(c).token_ids) == len(sampled_tokens(c).logprobs) > 0 for c in choices)
    # each reply's sampling parameters, the streamed one's too, in chat's names
    assert [sampled_tokens(c).sampling_params for c in choices] == [
        SamplingParams(temperature=1.0, max_tokens=6),
        SamplingParams(temperature=1.0, max_tokens=80),
        SamplingParams(temperature=0.8, max_tokens=6),
    ]
    trajectory.check_trainable()


async def test_the_agents_sdk_default_responses_model_with_a_tool_and_a_previous_response_is_recorded(
    inference_app,
) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    looked_up: list[str] = []

    @function_tool
    def lookup(word: Literal["apple", "pear"]) -> str:  # an enum: the tiny model's call always ends
        """Look a word up in the dictionary."""
        looked_up.append(word)
        return f"{word}: a word"

    model = model_of(inference_app)
    async with model.capture() as session:
        agent = Agent(
            name="assistant",
            instructions="Look up the word the user gives.",
            model=OpenAIResponsesModel(model=model.name, openai_client=session.openai_client(max_retries=0)),
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=1.0
            ),
            tools=[lookup],
            tool_use_behavior="stop_on_first_tool",
        )
        result = await Runner.run(agent, "apple", max_turns=2)
        # the SDK continues on the server's stored response: it sends the new input alone
        followed = await Runner.run(agent, "pear", max_turns=2, previous_response_id=result.last_response_id)
        trajectory = await session.trajectory(reward=1.0)
    assert (
        result.final_output == f"{looked_up[0]}: a word"
        and followed.final_output == f"{looked_up[1]}: a word"
    )
    # the chain is one conversation: the second turn's prompt holds the first turn's call as sampled
    assert not trajectory.additional_histories
    first, second = trajectory.trainable_choices()
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"word": looked_up[0]}
    assert json.loads(second.message.tool_calls[0].function.arguments) == {"word": looked_up[1]}
    assert trajectory.messages()[0] == {"role": "system", "content": "Look up the word the user gives."}
    assert [m["content"] for m in trajectory.messages() if m["role"] == "user"] == ["apple", "pear"]
    trajectory.check_trainable()


async def test_anthropic_messages_plain_with_a_tool_and_streamed_are_recorded_as_sampled(
    inference_app,
) -> None:
    model = model_of(inference_app)
    async with model.capture() as session:
        client = anthropic_client(session.anthropic_base_url, model.api_key)
        messages: list = [{"role": "user", "content": "Name a color."}]
        first = await client.messages.create(
            model=model.name,
            system="Be brief.",
            messages=messages,
            tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "none"},
            max_tokens=6,
            extra_body={"temperature": 1.0},
        )
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": "Look it up."},
        ]
        called = await client.messages.create(
            model=model.name,
            system="Be brief.",
            messages=messages,
            tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            max_tokens=80,
            extra_body={"temperature": 1.0},
        )
        (tool_use,) = [block for block in called.content if block.type == "tool_use"]
        messages += [
            {"role": "assistant", "content": called.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "a hue"}],
            },
        ]
        async with client.messages.stream(
            model=model.name,
            system="Be brief.",
            messages=messages,
            tools=[ANTHROPIC_TOOL],
            max_tokens=6,
            extra_body={"temperature": 0.6, "top_k": 20},
        ) as stream:
            streamed_text = "".join([text async for text in stream.text_stream])
            final = await stream.get_final_message()
        trajectory = await session.trajectory(reward=1.0)
    assert called.stop_reason == "tool_use" and first.model == f"{model.name}@0"
    assert streamed_text == "".join(block.text for block in final.content if block.type == "text")
    choices = trajectory.trainable_choices()
    assert not trajectory.additional_histories and len(choices) == 3
    assert choices[0].message.content == first.content[0].text
    assert json.loads(choices[1].message.tool_calls[0].function.arguments) == tool_use.input
    assert trajectory.messages()[0] == {"role": "system", "content": "Be brief."}
    assert [m for m in trajectory.messages() if m["role"] == "tool"][0]["content"] == "a hue"
    assert sampled_tokens(choices[2]).sampling_params == SamplingParams(
        temperature=0.6, top_k=20, max_tokens=6
    )
    assert sampled_tokens(choices[2]).sampling_params.truncates
    trajectory.check_trainable()


async def test_bad_input_is_each_protocols_own_error(inference_app) -> None:
    model = model_of(inference_app)
    client = openai.AsyncOpenAI(base_url=model.base_url, api_key=model.api_key, max_retries=0)
    claude = anthropic_client(model.base_url.removesuffix("/v1"), model.api_key)
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.responses.create(model="no-such-model", input="hi")
    with pytest.raises(anthropic.NotFoundError, match="does not exist") as missing:
        await claude.messages.create(model="no-such-model", messages=hello, max_tokens=4)
    # Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=model.base_url, api_key="wrong", max_retries=0).responses.create(
            model=model.name, input="hi"
        )
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await anthropic_client(model.base_url.removesuffix("/v1"), "wrong").messages.create(
            model=model.name, messages=hello, max_tokens=4
        )
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.BadRequestError, match="input"):
        await client.responses.create(model=model.name, input=[{"type": "no_such_item"}])
    with pytest.raises(openai.NotFoundError, match="resp_1"):
        await client.responses.create(model=model.name, input="hi", previous_response_id="resp_1")
    with pytest.raises(anthropic.BadRequestError) as too_long:  # past the engine's 512-token context
        await claude.messages.create(model=model.name, messages=hello, max_tokens=4096)
    assert too_long.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=model.name, input="hi", max_output_tokens=100_000)


async def test_text_completions_are_recorded_with_their_prompt_tokens(inference_app) -> None:
    model = model_of(inference_app)
    async with model.capture() as session:
        client = session.openai_client(max_retries=0)
        plain = await client.completions.create(
            model=model.name, prompt="Once upon", max_tokens=5, temperature=1.0
        )
        stream = await client.completions.create(
            model=model.name, prompt="Once upon a time", max_tokens=5, temperature=1.0, stream=True
        )
        streamed = "".join([chunk.choices[0].text async for chunk in stream])
        with pytest.raises(openai.BadRequestError, match="one prompt"):
            await client.completions.create(model=model.name, prompt=["a", "b"], max_tokens=2)
        trajectory = await session.trajectory(reward=1.0)
    histories = trajectory.histories()
    assert [h.messages()[0]["content"] for h in histories] == ["Once upon", "Once upon a time"]
    first, second = (history.trainable_choices()[0] for history in histories)
    assert first.message.content == plain.choices[0].text and second.message.content == streamed
    assert sampled_tokens(first).token_ids == plain.choices[0].model_extra["token_ids"]
    assert sampled_tokens(first).prompt_token_ids == plain.choices[0].model_extra["prompt_token_ids"]
    assert len(sampled_tokens(second).token_ids) == len(sampled_tokens(second).logprobs) > 0
    trajectory.check_trainable()
