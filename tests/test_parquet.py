import pandas as pd
import pyarrow.parquet as pq
from factories import served_choice
from openai.types.chat.chat_completion import Choice

from art_ray import (
    History,
    SamplingParams,
    Trajectory,
    TrajectoryGroup,
    read_trajectory_groups,
    sampled_tokens,
    write_trajectory_groups,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]


def sample_groups() -> list[TrajectoryGroup]:
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    multi_turn = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "add 1"},
            served_choice("", token_ids=(7, 8, 9), logprobs=(-0.1, -0.2, -0.3), tool_calls=[tool_call]),
            {"role": "tool", "tool_call_id": "call_1", "content": "1"},
            served_choice(
                "It is 1.", token_ids=(4,), logprobs=(-0.7,), sampling_params={"temperature": 0.7, "seed": 5}
            ),
        ],
        tools=TOOLS,
        additional_histories=[
            History(messages_and_choices=[{"role": "user", "content": "judge"}, served_choice("ok")])
        ],
        reward=0.75,
        metrics={"turns": 2, "solved": True, "score": 0.5},
        metadata={"scenario": "add", "seed": 3, "hard": False, "note": None},
        logs=["called add"],
    )
    simple = Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, served_choice()], reward=-1.0
    )
    return [
        TrajectoryGroup([multi_turn, simple], metadata={"step": 4}),
        TrajectoryGroup([], exceptions=[RuntimeError("all rollouts failed")]),
        TrajectoryGroup([simple]),
    ]


def test_parquet_round_trip_returns_the_same_groups(tmp_path) -> None:
    groups = sample_groups()
    path = tmp_path / "nested" / "0004.parquet"
    write_trajectory_groups(groups, path)
    restored = read_trajectory_groups(path)
    assert [g.model_dump() for g in restored] == [g.model_dump() for g in groups]
    choice = restored[0].trajectories[0].messages_and_choices[1]
    assert isinstance(choice, Choice)
    assert choice.message.tool_calls[0].function.name == "add"
    # what a choice was sampled with comes back, so a trajectory read from Parquet trains at its temperature
    answer = restored[0].trajectories[0].messages_and_choices[3]
    assert sampled_tokens(answer).sampling_params == SamplingParams(temperature=0.7, seed=5)
    assert restored[1].exceptions[0].message == "all rollouts failed"


def test_parquet_is_readable_by_pandas_with_the_documented_columns(tmp_path) -> None:
    path = tmp_path / "groups.parquet"
    write_trajectory_groups(sample_groups(), path)
    frame = pd.read_parquet(path)
    assert list(frame.columns) == [
        "group_index",
        "trajectory_index",
        "reward",
        "metrics",
        "metadata",
        "logs",
        "messages_and_choices",
        "tools",
        "additional_histories",
        "initial_policy_version",
        "final_policy_version",
    ]
    assert frame["reward"].tolist() == [0.75, -1.0, -1.0]
    assert frame["group_index"].tolist() == [0, 0, 2]
    assert dict(frame["metrics"][0])["turns"] == 2.0
    assert pq.read_schema(path).metadata[b"art_ray.schema_version"] == b"1"
