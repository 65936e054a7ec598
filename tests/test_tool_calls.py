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
    """One lookup call, its result, then an answer. "required" makes vLLM constrain the output to a call;
    greedy, because vLLM's hermes grammar fixes the call's frame but not its arguments, where a 135M model
    sampling at temperature 1 may wander off JSON."""
    client = model.openai_client()
    first = (
        await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=48,
            temperature=0.0,
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
