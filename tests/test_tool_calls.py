"""Tool calls end to end: the local models' template renders `tools`, vLLM's hermes parser reads what the
template writes, the endpoint returns `tool_calls` with token ids, and a trajectory with a tool call and
a tool result trains one step with the result as context only.
"""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoTokenizer

from art_ray import Trajectory, TrajectoryGroup, sampled_tokens
from art_ray.models import SMOLLM2, TINY, default_tool_call_parser, prepare
from art_ray.trainer.batches import tokenize_groups
from art_ray.trajectories import get_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up in the dictionary.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "maxLength": 12}},
                "required": ["word"],
            },
        },
    }
]
TOOL_RESULT = "ZEBRA-STRIPES-RESULT"
QUESTION = [{"role": "user", "content": "What does 'apple' mean?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(prepare(TINY)))


def test_without_tools_the_template_renders_smollm2s_own_format(tokenizer) -> None:
    reply, thanks = {"role": "assistant", "content": "A fruit."}, {"role": "user", "content": "Thanks"}
    messages = [*QUESTION, reply, thanks]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat does 'apple' mean?<|im_end|>\n<|im_start|>assistant\nA fruit.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_hermes_parser_reads_the_tool_calls_the_template_writes(tokenizer) -> None:
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    assert default_tool_call_parser(TINY) == "hermes"
    assert default_tool_call_parser("Qwen/Qwen2.5-7B-Instruct") is None
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "apple"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "lookup"' in rendered
    assistant_turn = rendered.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    parsed = Hermes2ProToolParser(tokenizer).extract_tool_calls(assistant_turn, request=None)
    assert parsed.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("lookup", {"word": "apple"})
    ]
    with_result = [*messages, {"role": "tool", "tool_call_id": "c1", "content": TOOL_RESULT}]
    assert tokenizer.apply_chat_template(with_result, tools=TOOLS, tokenize=False).endswith(
        f"<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response><|im_end|>\n"
    )


async def tool_trajectory(model, reward: float) -> Trajectory:
    """One lookup call, its result, then an answer. "required" makes vLLM constrain the output to a call
    whose arguments match the tool's schema (tool_strict_level "parameter"), so sampling at temperature 1
    still gives a call the agent can run."""
    client = model.openai_client()
    first = (
        await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,  # one call: a second one cut off by max_tokens would void both
            # above the longest call the grammar allows (~20 tokens of frame, 12 characters of up to 4
            # byte-tokens each, runs of up to 4 spaces): 48 cut off a call of the trained model once in a run
            max_tokens=128,
            temperature=1.0,
        )
    ).choices[0]
    call = first.message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}
    history = [*QUESTION, first, result]
    second = (
        await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=get_messages(history),
            tools=TOOLS,
            tool_choice="none",
            max_tokens=8,
            temperature=1.0,
        )
    ).choices[0]
    return Trajectory(messages_and_choices=[*history, second], tools=TOOLS, reward=reward)


@pytest.mark.slow
async def test_a_tool_call_and_its_result_train_one_step(smollm2_model) -> None:
    model = smollm2_model.model
    tokenizer = AutoTokenizer.from_pretrained(str(prepare(SMOLLM2)))
    step = await model.get_step()
    trajectories = [await tool_trajectory(model, reward=float(i % 2)) for i in range(4)]

    first = trajectories[0].messages_and_choices[1]
    assert first.message.tool_calls[0].function.name == "lookup"
    assert set(json.loads(first.message.tool_calls[0].function.arguments)) == {"word"}
    prompt = tokenizer.decode(sampled_tokens(first).prompt_token_ids)
    assert "<tools>" in prompt and '"name": "lookup"' in prompt

    # the tool result is context: in a prompt, never among the trained tokens
    sequences, stats = tokenize_groups([TrajectoryGroup(trajectories)], tokenizer)
    sampled = sum(
        len(sampled_tokens(item).token_ids)
        for t in trajectories
        for item in t.messages_and_choices
        if not isinstance(item, dict)
    )
    assert stats.trainable_tokens == sampled

    def text(trainable: bool) -> str:
        return "".join(
            tokenizer.decode([i for i, t in zip(s.input_ids, s.trainable, strict=True) if t == trainable])
            for s in sequences
        )

    assert f"<tool_response>\n{TOOL_RESULT}\n</tool_response>" in text(False)
    assert TOOL_RESULT not in text(True)

    assert await model.train([TrajectoryGroup(trajectories)], verbose=False) == step + 1
    metrics = model.last_train_metrics[0]
    assert metrics["data/step_trainable_tokens"] == sampled
    assert math.isfinite(metrics["loss/train"]) and metrics["loss/grad_norm"] > 0


# --- what the tool-call grammar constrains (ModelConfig.tool_strict_level, default "parameter") ----------
# The session app serves `tiny`, a random model: whatever it writes unconstrained is garbage, so every
# well-formed call it makes is the grammar's doing. Tools as LangChain and most clients send them, without
# `strict`. The calls' JSON allows at most 4 whitespace characters in a row (tool_call_max_whitespace; with
# vLLM's unbounded whitespace the random model writes whitespace until max_tokens), the schema bounds its
# integers and the requests ask for one call, so a constrained call ends in a few dozen tokens.

ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
        "op": {"enum": ["plus", "minus"]},
    },
    "required": ["a", "b", "op"],
    "additionalProperties": False,
}
ADD_TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ADD}}
]
ADD_QUESTION = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
FORCED = {"required": "required", "named": {"type": "function", "function": {"name": "add"}}}


CALL_REQUEST = {
    "messages": ADD_QUESTION,
    "tools": ADD_TOOLS,
    "parallel_tool_calls": False,
    "max_tokens": 96,
    "temperature": 1.0,
}


def assert_schema_valid(name: str, arguments: str) -> None:
    import jsonschema

    assert name == "add"
    jsonschema.validate(json.loads(arguments), ADD)


def tiny_client(app):  # noqa: ANN001, ANN201
    import openai

    return openai.AsyncOpenAI(base_url=app.base_url, api_key=app.api_key, max_retries=0)


@pytest.mark.parametrize("mode", FORCED)
async def test_forced_calls_to_non_strict_tools_match_the_schema_on_every_version(
    inference_app, mode
) -> None:
    from conftest import CHECKPOINT_MODEL

    client = tiny_client(inference_app)
    # two LoRA versions (step 0 of the session's model, a trained checkpoint), n > 1, both replicas
    for model in (inference_app.model, f"{CHECKPOINT_MODEL}@5"):
        completion = await client.chat.completions.create(
            model=model, tool_choice=FORCED[mode], n=4, **CALL_REQUEST
        )
        for choice in completion.choices:
            # a named function finishes as "stop" (OpenAI's behaviour), "required" as "tool_calls"
            assert choice.finish_reason in ("tool_calls", "stop") and choice.message.tool_calls, (
                choice.message
            )
            for call in choice.message.tool_calls:
                assert_schema_valid(call.function.name, call.function.arguments)


@pytest.mark.parametrize("mode", FORCED)
async def test_streamed_forced_calls_match_the_schema(inference_app, mode) -> None:
    stream = await tiny_client(inference_app).chat.completions.create(
        model=inference_app.model, tool_choice=FORCED[mode], n=2, stream=True, **CALL_REQUEST
    )
    calls: dict[tuple[int, int], list[str]] = {}  # (choice, call) -> [name, arguments]
    finished = {}
    async for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault((choice.index, delta.index), ["", ""])
                call[0] += (delta.function and delta.function.name) or ""
                call[1] += (delta.function and delta.function.arguments) or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1} and set(finished.values()) <= {"tool_calls", "stop"}
    assert {index for index, _ in calls} == {0, 1}
    for name, arguments in calls.values():
        assert_schema_valid(name, arguments)


async def test_a_forced_call_in_a_capture_session_is_recorded_schema_valid(inference_app) -> None:
    from art_ray import Model

    model = Model(
        name=inference_app.model,
        project="tools",
        base_url=inference_app.base_url,
        api_key=inference_app.api_key,
    )
    async with model.capture() as session:
        await session.openai_client(max_retries=0).chat.completions.create(
            model=model.name, tool_choice="required", **CALL_REQUEST
        )
        trajectory = await session.trajectory(reward=1.0)
    (choice,) = trajectory.trainable_choices()
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_schema_valid(call.function.name, call.function.arguments)
    assert trajectory.tools == ADD_TOOLS


async def test_auto_tool_choice_still_lets_the_model_answer_in_text(inference_app) -> None:
    """The grammar applies once a call opens; under "auto" the random model does not open one."""
    completion = await tiny_client(inference_app).chat.completions.create(
        model=inference_app.model, tool_choice="auto", n=4, **{**CALL_REQUEST, "max_tokens": 16}
    )
    assert any(not choice.message.tool_calls and choice.message.content for choice in completion.choices)


@pytest.mark.slow
async def test_a_langgraph_forced_tool_call_round_trip_trains_a_step(smollm2_model) -> None:
    """LangGraph over ChatOpenAI, as users write it: a forced call to a tool without `strict`, the tool runs
    on the arguments LangChain parsed (it raises on arguments that are not the schema's object), then a text
    answer; the capture session's trajectory trains a step."""
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    model = smollm2_model.model
    step = await model.get_step()

    async def run(reward: float) -> tuple[list, Trajectory]:
        async with model.capture() as session:
            llm = ChatOpenAI(
                model=session.model,
                base_url=session.base_url,
                api_key=session.api_key or "unused",  # the fixture's endpoint has no key
                temperature=1.0,
                max_tokens=48,
            )

            async def agent(state: MessagesState) -> dict:
                called = any(message.type == "tool" for message in state["messages"])
                bound = llm.bind_tools(
                    [add], tool_choice="none" if called else "required", parallel_tool_calls=False
                )
                return {"messages": [await bound.ainvoke(state["messages"])]}

            def tools(state: MessagesState) -> dict:
                calls = state["messages"][-1].tool_calls
                return {
                    "messages": [ToolMessage(str(add.invoke(c["args"])), tool_call_id=c["id"]) for c in calls]
                }

            graph = StateGraph(MessagesState)
            graph.add_node("agent", agent)
            graph.add_node("tools", tools)
            graph.add_edge(START, "agent")
            graph.add_conditional_edges("agent", lambda s: "tools" if s["messages"][-1].tool_calls else END)
            graph.add_edge("tools", "agent")
            state = await graph.compile().ainvoke(
                {"messages": [("user", "Use the add tool to add 2 and 3.")]}, {"recursion_limit": 6}
            )
            return state["messages"], await session.trajectory(reward=reward)

    runs = [await run(reward) for reward in (0.0, 1.0)]
    for messages, trajectory in runs:
        assert [m.type for m in messages] == ["human", "ai", "tool", "ai"]
        call = messages[1].tool_calls[0]
        assert not messages[1].invalid_tool_calls and call["name"] == "add"
        assert messages[2].content == str(call["args"]["a"] + call["args"]["b"])
        assert len(trajectory.trainable_choices()) == 2
    assert await model.train([TrajectoryGroup([t for _, t in runs])], verbose=False) == step + 1
    assert await model.get_step() == step + 1
