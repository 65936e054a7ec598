import math
import pickle

import pydantic
import pytest
from factories import served_choice
from openai.types.chat.chat_completion import Choice

from art_ray import (
    History,
    MissingTokenDataError,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    sampled_tokens,
)


def make_trajectory(reward: float = 1.0) -> Trajectory:
    return Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
            served_choice(),
        ],
        reward=reward,
        metrics={"turns": 1, "correct": True},
        metadata={"scenario": "paris"},
    )


def test_choices_stay_choices_and_messages_stay_dicts() -> None:
    trajectory = make_trajectory()
    assert isinstance(trajectory.messages_and_choices[2], Choice)
    assert trajectory.messages_and_choices[0] == {"role": "system", "content": "Be brief."}
    assert trajectory.messages()[2] == {"role": "assistant", "content": "Paris"}
    assert len(trajectory.trainable_choices()) == 1


def test_model_dump_round_trip_keeps_choices_trainable() -> None:
    trajectory = make_trajectory()
    restored = Trajectory.model_validate(trajectory.model_dump())
    assert isinstance(restored.messages_and_choices[2], Choice)
    assert sampled_tokens(restored.messages_and_choices[2]).token_ids == [11, 12]
    assert restored.model_dump() == trajectory.model_dump()
    json_restored = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert json_restored.model_dump() == trajectory.model_dump()


def test_pickle_round_trip_for_ray() -> None:
    group = TrajectoryGroup([make_trajectory(0.0), make_trajectory(1.0)], metadata={"step": 3})
    restored = pickle.loads(pickle.dumps(group))
    assert restored.model_dump() == group.model_dump()
    assert isinstance(restored, TrajectoryGroup)


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_rejected(reward: float) -> None:
    with pytest.raises(pydantic.ValidationError, match="reward must be a finite number"):
        make_trajectory(reward)


def test_non_finite_metric_is_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="metric 'score' must be finite"):
        Trajectory(messages_and_choices=[], metrics={"score": math.nan})


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "robot", "content": "hi"}, "role must be one of"),
        ({"content": "hi"}, "role must be one of"),
        ({"role": "user", "content": 3}, "content must be a string"),
        ({"role": "user"}, "content is required"),
        ({"role": "tool", "content": "42"}, "tool_call_id is required"),
    ],
)
def test_malformed_messages_are_rejected(message: dict, error: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=error):
        Trajectory(messages_and_choices=[{"role": "user", "content": "ok"}, message])


def test_malformed_message_error_names_its_index() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"messages_and_choices\[1\]"):
        Trajectory(messages_and_choices=[{"role": "user", "content": "ok"}, {"role": "x", "content": ""}])


def test_sampled_tokens_from_token_ids_or_token_id_strings() -> None:
    direct = sampled_tokens(served_choice(token_ids=(5, 6, 7), logprobs=(-1.0, -2.0, -3.0)))
    parsed = sampled_tokens(
        served_choice(token_ids=(5, 6, 7), logprobs=(-1.0, -2.0, -3.0), with_token_ids=False)
    )
    assert direct.token_ids == parsed.token_ids == [5, 6, 7]
    assert direct.logprobs == [-1.0, -2.0, -3.0]
    assert direct.prompt_token_ids == [1, 2, 3]


def test_choice_without_logprobs_is_not_trainable() -> None:
    bare = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
    )
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, bare])
    with pytest.raises(MissingTokenDataError, match="no logprobs"):
        trajectory.check_trainable()
    make_trajectory().check_trainable()


def test_missing_logprobs_in_additional_history_names_the_history() -> None:
    bare = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
    )
    trajectory = make_trajectory()
    trajectory.additional_histories.append(History(messages_and_choices=[bare]))
    with pytest.raises(MissingTokenDataError, match=r"additional_histories\[0\]"):
        trajectory.check_trainable()


def test_group_records_exceptions_given_among_trajectories() -> None:
    group = TrajectoryGroup([make_trajectory(), ValueError("rollout failed")])
    assert len(group) == 1
    assert group.exceptions[0].type == "builtins.ValueError"
    assert group.exceptions[0].message == "rollout failed"
    assert "ValueError" in group.exceptions[0].traceback


async def test_group_of_rollout_coroutines_is_awaitable() -> None:
    async def rollout(reward: float) -> Trajectory:
        return make_trajectory(reward)

    async def failing() -> Trajectory:
        raise RuntimeError("boom")

    group = await TrajectoryGroup([rollout(0.0), rollout(1.0), failing()], metadata={"id": 1})
    assert isinstance(group, TrajectoryGroup)
    assert group.rewards == [0.0, 1.0]
    assert group.metadata == {"id": 1}
    assert [e.message for e in group.exceptions] == ["boom"]


def test_train_config_defaults_and_validation() -> None:
    config = TrainConfig(learning_rate=1e-4)
    assert config.clip_high == config.epsilon == 0.2
    assert TrainConfig(epsilon_high=0.28).clip_high == 0.28
    with pytest.raises(pydantic.ValidationError):
        TrainConfig(learning_rate=-1)
    with pytest.raises(pydantic.ValidationError):
        TrainConfig(lerning_rate=1e-4)


def test_group_from_a_generator_keeps_its_trajectories_and_exceptions() -> None:
    items = (item for item in [make_trajectory(0.0), ValueError("lost"), make_trajectory(1.0)])
    group = TrajectoryGroup(items, metadata={"k": 1})
    assert group.rewards == [0.0, 1.0]
    assert [e.message for e in group.exceptions] == ["lost"]
    assert group.metadata == {"k": 1}


@pytest.mark.parametrize(
    "group", [{"trajectories": 1.5}, {"exceptions": ""}, {"trajectories": "abc"}, {"exceptions": {"a": 1}}]
)
def test_a_group_list_field_of_another_type_is_a_validation_error(group: dict) -> None:
    """Found by fuzzing /_art/train: a float for `trajectories` was a TypeError (a 500), a string for
    `exceptions` an empty list (accepted); both are validation errors now (a 400 on the wire)."""
    import pydantic

    from art_ray.remote.protocol import LogRequest, TrainRequest

    with pytest.raises(pydantic.ValidationError, match="must be a list"):
        TrainRequest.model_validate({"model": "m", "groups": [group]})
    with pytest.raises(pydantic.ValidationError, match="metric name"):
        LogRequest.model_validate({"model": "m", "groups": [], "metrics": {"": 1.0}})
