"""SDK input that used to be accepted silently gets a clear, typed error (or a warning) at the call."""

from __future__ import annotations

import math
import warnings

import pydantic
import pytest
from factories import served_choice

from art_ray import Trajectory, TrajectoryGroup
from art_ray.adapters.spec import validate_model_name
from art_ray.batch_check import check_train_groups
from art_ray.errors import NothingToTrainError

PROMPT = {"role": "user", "content": "Capital of France?"}


def trajectory(reward: float, turn) -> Trajectory:
    return Trajectory(messages_and_choices=[PROMPT, turn], reward=reward)


def test_a_name_with_a_trailing_newline_is_refused() -> None:
    validate_model_name("agent-1")
    with pytest.raises(ValueError):
        validate_model_name("agent-1\n")


def test_a_reward_set_to_nan_after_construction_fails_at_the_assignment() -> None:
    t = trajectory(1.0, served_choice())
    with pytest.raises(pydantic.ValidationError, match="finite"):
        t.reward = math.nan
    t.reward = 0  # still a float
    assert t.reward == 0.0 and isinstance(t.reward, float)


def test_no_trajectories_at_all_is_nothing_to_train() -> None:
    with pytest.raises(NothingToTrainError, match="no trajectories"):
        check_train_groups([])
    with pytest.raises(NothingToTrainError, match="exceptions"):
        check_train_groups([TrajectoryGroup([RuntimeError("rollout failed")]), TrajectoryGroup([])])


def test_assistant_turns_appended_as_messages_name_the_fix() -> None:
    plain = {"role": "assistant", "content": "Paris"}
    groups = [TrajectoryGroup([trajectory(1.0, plain), trajectory(0.0, plain)])]
    with pytest.raises(NothingToTrainError, match=r"not `choice.message`"):
        check_train_groups(groups)
    check_train_groups(groups, plain_assistant_trains=True)  # allow_training_without_logprobs trains them


def test_equal_rewards_warn_and_a_reward_spread_does_not() -> None:
    flat = [TrajectoryGroup([trajectory(1.0, served_choice()), trajectory(1.0, served_choice())])]
    with pytest.warns(UserWarning, match="different rewards"):
        check_train_groups(flat)
    spread = [*flat, TrajectoryGroup([trajectory(1.0, served_choice()), trajectory(0.0, served_choice())])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_train_groups(spread)


def test_what_the_fuzzer_sent_the_training_routes_is_refused_at_once() -> None:
    """bench/fuzz.py's 20,000-request run: a register with world_size 117,327,737 kept the training
    server busy past the client's 2-minute timeout, and a release action with `"step": false` was taken
    as step 0."""
    from art_ray import ModelConfig
    from art_ray.releases import ReleaseAction

    with pytest.raises(pydantic.ValidationError, match="world_size"):
        ModelConfig(world_size=117_327_737)
    assert ModelConfig(world_size=4096).world_size == 4096
    with pytest.raises(pydantic.ValidationError, match="step"):
        ReleaseAction.model_validate_json('{"action": "start", "step": false}')
    assert ReleaseAction.model_validate_json('{"action": "start", "step": 3}').step == 3
