"""What a train call's groups can teach, checked on the caller's side before anything is sent."""

from __future__ import annotations

import warnings

from art_ray.errors import NothingToTrainError
from art_ray.sampling import CHOICE_KEY
from art_ray.trajectories import TrajectoryGroup, is_choice


def _has_plain_assistant_turn(group: TrajectoryGroup) -> bool:
    return any(
        not is_choice(item) and item.get("role") == "assistant"
        for trajectory in group.trajectories
        for history in trajectory.histories()
        for item in history.messages_and_choices
    )


def _has_choice(group: TrajectoryGroup) -> bool:
    return any(
        history.trainable_choices() for trajectory in group.trajectories for history in trajectory.histories()
    )


def check_train_groups(groups: list[TrajectoryGroup], plain_assistant_trains: bool = False) -> None:
    """Raise NothingToTrainError when the call could train nothing at all; warn when no group has a
    reward spread (the step still advances with the same adapter, as ART's backends do)."""
    with_trajectories = [group for group in groups if group.trajectories]
    if not with_trajectories:
        raise NothingToTrainError(
            f"train() got {len(groups)} group(s) and no trajectories: nothing was trained and the step did "
            "not advance (did every rollout fail? see each group's `exceptions`)"
        )
    if not plain_assistant_trains and not any(_has_choice(group) for group in with_trajectories):
        hint = (
            "their assistant turns are plain messages: append the Choice itself "
            "(`messages_and_choices.append(choice)`), not `choice.message`, so its sampled tokens train"
            if any(_has_plain_assistant_turn(group) for group in with_trajectories)
            else "append each sampled Choice to the trajectory's messages_and_choices"
        )
        raise NothingToTrainError(f"no trajectory holds a served choice to train on: {hint}")
    if not any(group.has_signal for group in with_trajectories):
        warnings.warn(
            "no group has trajectories with different rewards (or off its baseline), so no trajectory has "
            "an advantage: the step advances with the same adapter",
            stacklevel=4,
        )


def choices_without_sampling_params(groups: list[TrajectoryGroup]) -> int:
    """How many of the groups' served choices carry no recorded sampling parameters: they train at
    temperature 1 (trajectories of older versions, built by hand, or ART's)."""
    return sum(
        CHOICE_KEY not in (choice.model_extra or {})
        for group in groups
        for trajectory in group.trajectories
        for history in trajectory.histories()
        for choice in history.trainable_choices()
    )


def warn_unrecorded_sampling(model_name: str, count: int) -> None:
    warnings.warn(
        f"{model_name}: {count} choice(s) carry no sampling_params (not served by an art-ray endpoint of "
        "this version, or built by hand): they train at temperature 1, which is right only if they were "
        "sampled at it. Said once per run.",
        stacklevel=4,
    )
