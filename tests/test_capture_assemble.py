"""Captured turns -> Trajectory: pure logic on hand-built records shaped like what the endpoint serves."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

from art_ray.capture.assemble import build_trajectory, message_key
from art_ray.capture.turns import CapturedTurn
from art_ray.errors import ArtRayError, CaptureError
from art_ray.trajectories import Trajectory, is_choice, sampled_tokens

SYSTEM = {"role": "system", "content": "You answer questions about the weather."}
USER = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def choice_dict(
    text: str | None,
    token_ids: list[int],
    *,
    tool_calls: list[dict] | None = None,
    prompt_token_ids: list[int] | None = None,
    policy_version: int = 3,
) -> dict[str, Any]:
    """A chat choice as the client receives it from the art-ray endpoint (non-streaming)."""
    return {
        "index": 0,
        "finish_reason": "tool_calls" if tool_calls else "stop",
        "message": {"role": "assistant", "content": text, "tool_calls": tool_calls or []},
        "logprobs": {
            "content": [
                {
                    "token": f"token_id:{token_id}",
                    "logprob": -0.1 * (i + 1),
                    "bytes": None,
                    "top_logprobs": [],
                }
                for i, token_id in enumerate(token_ids)
            ]
        },
        "token_ids": token_ids,
        "prompt_token_ids": prompt_token_ids if prompt_token_ids is not None else [1, 2, 3],
        "policy_version": policy_version,
    }


def weather_call(call_id: str = "chatcmpl-tool-8f1e", arguments: str = '{"city": "Paris"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def turn(
    messages: list[dict], choice: dict, tools: list[dict] | None = None, at: float = 0.0
) -> CapturedTurn:
    return CapturedTurn(request_messages=messages, tools=tools, choice=choice, model="agent@3", created_at=at)


def tool_agent_turns() -> list[CapturedTurn]:
    """A tool-using agent as LangChain replays it: the recorded assistant message comes back re-serialized
    (content None, arguments re-dumped with other spacing, a regenerated tool-call id)."""
    first = choice_dict(None, [101, 102, 103], tool_calls=[weather_call()], policy_version=3)
    rewritten = {
        "role": "assistant",
        "content": "",
        "tool_calls": [weather_call("call_0", '{"city":"Paris"}')],
    }
    result = {"role": "tool", "tool_call_id": "call_0", "content": "18C, sunny"}
    second = choice_dict(
        "It is 18C and sunny in Paris.", [201, 202], prompt_token_ids=[1, 2, 3, 4], policy_version=4
    )
    return [
        turn([SYSTEM, USER], first, WEATHER_TOOLS, at=1.0),
        turn([SYSTEM, USER, rewritten, result], second, WEATHER_TOOLS, at=2.0),
    ]


def test_a_single_turn_becomes_the_conversation_with_the_served_choice() -> None:
    served = choice_dict("Sunny.", [11, 12, 13], prompt_token_ids=[5, 6, 7])
    trajectory = build_trajectory([turn([SYSTEM, USER], served)], reward=1.0, metrics={"correct": True})

    assert trajectory.messages_and_choices[:2] == [SYSTEM, USER]
    choice = trajectory.messages_and_choices[2]
    assert isinstance(choice, Choice) and is_choice(choice)
    tokens = sampled_tokens(choice)
    assert tokens.token_ids == [11, 12, 13] and tokens.prompt_token_ids == [5, 6, 7]
    assert tokens.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert trajectory.additional_histories == [] and trajectory.tools is None
    assert (trajectory.reward, trajectory.metrics) == (1.0, {"correct": True})
    assert (trajectory.initial_policy_version, trajectory.final_policy_version) == (3, 3)
    trajectory.check_trainable()
    # what the driver ships to the trainer keeps the token data
    back = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert sampled_tokens(back.messages_and_choices[2]).token_ids == [11, 12, 13]


def test_a_tool_call_and_its_result_continue_one_conversation_despite_rewritten_ids_and_arguments() -> None:
    turns = tool_agent_turns()
    trajectory = build_trajectory(turns, reward=0.5)

    assert trajectory.additional_histories == []
    assert trajectory.tools == WEATHER_TOOLS
    items = trajectory.messages_and_choices
    assert [type(item).__name__ for item in items] == ["dict", "dict", "Choice", "dict", "Choice"]
    assert items[3] == {"role": "tool", "tool_call_id": "call_0", "content": "18C, sunny"}
    # the recorded choice stays: its sampled tokens, not the framework's re-serialized copy
    assert items[2].message.tool_calls[0].id == "chatcmpl-tool-8f1e"
    assert [sampled_tokens(choice).token_ids for choice in trajectory.trainable_choices()] == [
        [101, 102, 103],
        [201, 202],
    ]
    assert (trajectory.initial_policy_version, trajectory.final_policy_version) == (3, 4)
    trajectory.check_trainable()


def test_a_rewritten_assistant_message_starts_an_additional_history_where_it_is_context_only() -> None:
    first = choice_dict("<think>Hmm.</think>Paris is sunny.", [31, 32, 33])
    # the framework stripped the reasoning it sent back: not the same message any more
    rewritten = {"role": "assistant", "content": "Paris is sunny."}
    follow_up = {"role": "user", "content": "And tomorrow?"}
    second = choice_dict("Rain.", [41])
    trajectory = build_trajectory(
        [turn([SYSTEM, USER], first), turn([SYSTEM, USER, rewritten, follow_up], second)], reward=1.0
    )

    assert [sampled_tokens(c).token_ids for c in trajectory.trainable_choices()] == [[31, 32, 33]]
    assert len(trajectory.additional_histories) == 1
    history = trajectory.additional_histories[0]
    assert history.messages_and_choices[:4] == [SYSTEM, USER, rewritten, follow_up]
    assert [sampled_tokens(c).token_ids for c in history.trainable_choices()] == [[41]]
    trajectory.check_trainable()


def subagent_turns() -> list[CapturedTurn]:
    """A main agent whose tool runs a sub-agent (a shorter prompt: its turns are matched first)."""
    research = {"type": "function", "function": {"name": "research", "parameters": {"type": "object"}}}
    main_call = {
        "id": "call_r",
        "type": "function",
        "function": {"name": "research", "arguments": '{"q": "x"}'},
    }
    sub_user = {"role": "user", "content": "Research x."}
    sub_first = choice_dict("Looking at x.", [71])
    sub_more = {"role": "user", "content": "Summarize."}
    main_first = choice_dict("", [61, 62], tool_calls=[main_call])
    main_result = {"role": "tool", "tool_call_id": "call_r", "content": "x is 42"}
    return [
        turn([SYSTEM, USER], main_first, [research], at=1.0),
        turn([sub_user], sub_first, at=2.0),
        turn([sub_user, sub_first["message"], sub_more], choice_dict("x = 42.", [72]), at=3.0),
        turn(
            [SYSTEM, USER, main_first["message"], main_result], choice_dict("42.", [63]), [research], at=4.0
        ),
    ]


def test_an_interleaved_sub_agent_becomes_an_additional_history_with_its_own_tools() -> None:
    trajectory = build_trajectory(subagent_turns(), reward=1.0)

    assert [sampled_tokens(c).token_ids for c in trajectory.trainable_choices()] == [[61, 62], [63]]
    assert trajectory.tools is not None and trajectory.tools[0]["function"]["name"] == "research"
    assert len(trajectory.additional_histories) == 1
    sub = trajectory.additional_histories[0]
    assert sub.tools is None
    assert [sampled_tokens(c).token_ids for c in sub.trainable_choices()] == [[71], [72]]
    assert sub.messages()[0]["content"] == "Research x."
    trajectory.check_trainable()


def test_records_delivered_out_of_order_assemble_the_same() -> None:
    turns = subagent_turns()
    in_order = build_trajectory(turns, reward=1.0)
    # the first given turn still picks the main conversation; the rest arrive child-before-parent
    shuffled = build_trajectory([turns[0], turns[3], turns[2], turns[1]], reward=1.0)
    assert shuffled.model_dump(exclude={"start_time"}) == in_order.model_dump(exclude={"start_time"})


def test_a_changed_tool_set_or_a_regenerated_prompt_starts_a_new_conversation() -> None:
    first = choice_dict("Sunny.", [11])
    follow_up = [SYSTEM, USER, first["message"], {"role": "user", "content": "Thanks"}]
    other_tools = build_trajectory(
        [turn([SYSTEM, USER], first, WEATHER_TOOLS), turn(follow_up, choice_dict("Bye.", [12]))], reward=0.0
    )
    assert len(other_tools.additional_histories) == 1 and other_tools.additional_histories[0].tools is None

    # the same prompt twice (n=2, or the agent retried): siblings, each trained once
    siblings = build_trajectory(
        [turn([SYSTEM, USER], first), turn([SYSTEM, USER], choice_dict("Cloudy.", [13]))], reward=0.0
    )
    assert [sampled_tokens(c).token_ids for c in siblings.trainable_choices()] == [[11]]
    assert [
        sampled_tokens(c).token_ids for h in siblings.additional_histories for c in h.trainable_choices()
    ] == [[13]]


def test_message_keys_ignore_ids_and_serialization_but_not_content() -> None:
    recorded = {
        "role": "assistant",
        "content": None,
        "tool_calls": [weather_call("chatcmpl-tool-1", '{"a": 1, "b": "é"}')],
    }
    replayed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [weather_call("call_9", '{"b":"\\u00e9","a":1}')],
    }
    assert message_key(recorded) == message_key(replayed)
    assert message_key({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == message_key(
        {"role": "user", "content": "hi"}
    )
    assert message_key({"role": "tool", "tool_call_id": "a", "content": "1"}) == message_key(
        {"role": "tool", "tool_call_id": "b", "content": "1"}
    )
    assert message_key({"role": "user", "content": "hi"}) != message_key({"role": "user", "content": "hi "})
    assert message_key(recorded) != message_key(
        {**replayed, "tool_calls": [weather_call(arguments='{"a": 2}')]}
    )


def test_no_turn_or_a_malformed_record_is_a_capture_error() -> None:
    with pytest.raises(CaptureError, match="recorded no completion"):
        build_trajectory([], reward=1.0)
    assert issubclass(CaptureError, ArtRayError) and issubclass(CaptureError, ValueError)
    with pytest.raises(CaptureError, match="turn 0"):
        build_trajectory([turn([USER], {"index": 0, "finish_reason": "stop"})], reward=1.0)
    with pytest.raises(CaptureError, match="conversation"):
        build_trajectory([turn([{"role": "tool", "content": "no id"}], choice_dict("ok", [1]))], reward=1.0)


def test_a_captured_turn_crosses_processes_as_json() -> None:
    recorded = tool_agent_turns()[1]
    assert CapturedTurn.model_validate_json(recorded.model_dump_json()) == recorded
    assert json.loads(recorded.model_dump_json())["choice"]["token_ids"] == [201, 202]


def test_capture_modules_stay_on_the_sdk_floor() -> None:
    heavy = {"torch", "ray", "vllm", "deepspeed", "mlflow", "pyarrow", "transformers", "openai"}
    script = (
        "import json, sys\n"
        "import art_ray.capture.turns, art_ray.capture.assemble\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    loaded = set(json.loads(completed.stdout.strip().splitlines()[-1]))
    assert not loaded & heavy, sorted(loaded & heavy)
