"""RULER (Relative Universal LLM-Elicited Rewards), compatible with ART's `art.rewards.ruler`.

A judge model sees every trajectory of a group side by side and scores each in [0, 1]; GRPO only needs
the relative order inside a group, so no labelled data or hand-written reward is needed. The group's
common message prefix (system prompt, task) is sent once as context and each trajectory's remainder
separately. The judge answers with JSON constrained by a schema that fixes the number of scores, so a
small judge served by vLLM (structured output) still returns something parseable.

Unlike ART (LiteLLM), the judge is any OpenAI-compatible endpoint: pass `client=` (an AsyncOpenAI), or
a served `Model`/`TrainableModel` as `judge_model`, or rely on OPENAI_API_KEY / OPENAI_BASE_URL.
"""

from __future__ import annotations

import json
from textwrap import dedent
from typing import Any

import pydantic
from openai import AsyncOpenAI

from art_ray.errors import ArtRayError
from art_ray.trajectories import Trajectory, TrajectoryGroup, get_messages

DEFAULT_RUBRIC = dedent(
    """
    - A trajectory that achieves its goal should always get a significantly higher score than a trajectory that does not achieve its goal.
    - A trajectory that achieves its goal more efficiently (eg. by avoiding unproductive detours) should get a higher score than a trajectory that achieves its goal less efficiently.
    - If one trajectory is only slightly better than another, the difference in scores should be small. If it is significantly better, the difference in scores should be large.
    - You may give some partial credit for a trajectory that makes progress towards its goal but does not complete it.
    """  # noqa: E501
)
JUDGE_INSTRUCTIONS = (
    "All of the trajectories below have been given the same goal. Your job is to consider each of them "
    "and give them a score between 0 and 1. Take into consideration your best judgement of the agent's "
    "goal.\n\nGrading standards:\n{rubric}"
)
# Bounds what a small judge can ramble per explanation, and so the length of its answer.
MAX_EXPLANATION_CHARS = 300


class RulerError(ArtRayError, ValueError):
    """The judge's answer could not be turned into one score per trajectory."""


class TrajectoryScore(pydantic.BaseModel):
    trajectory_id: str
    explanation: str
    score: float = pydantic.Field(ge=0.0, le=1.0)


class JudgeResponse(pydantic.BaseModel):
    scores: list[TrajectoryScore]


def response_schema(count: int) -> dict[str, Any]:
    """JSON schema of the judge's answer for `count` trajectories (ids "1".."count", in order)."""
    return {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "minItems": count,
                "maxItems": count,
                "items": {
                    "type": "object",
                    "properties": {
                        "trajectory_id": {"type": "string", "enum": [str(i) for i in range(1, count + 1)]},
                        "explanation": {"type": "string", "maxLength": MAX_EXPLANATION_CHARS},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                    "required": ["trajectory_id", "explanation", "score"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    }


def common_prefix_length(message_lists: list[list[dict]]) -> int:
    length = 0
    for index, message in enumerate(message_lists[0]):
        if all(len(messages) > index and messages[index] == message for messages in message_lists):
            length += 1
        else:
            break
    return length


def judge_messages(message_lists: list[list[dict]], rubric: str = DEFAULT_RUBRIC) -> tuple[list[dict], int]:
    """The judge's prompt, and how many trajectories it asks to score (1 when all are identical)."""
    prefix = common_prefix_length(message_lists)
    identical = len(message_lists) > 1 and all(len(m) == prefix for m in message_lists)
    text = ""
    if identical:
        # nothing to compare: ART scores the one trajectory absolutely and copies the score
        bodies = [message_lists[0]]
    else:
        if prefix:
            text += f"<context>\n{json.dumps(message_lists[0][:prefix])}\n</context>\n\n"
        bodies = [messages[prefix:] for messages in message_lists]
    text += "Trajectories:\n\n" + "\n\n".join(
        f'<trajectory id="{index}">\n{json.dumps(body)}\n</trajectory>'
        for index, body in enumerate(bodies, start=1)
    )
    messages = [
        {"role": "system", "content": JUDGE_INSTRUCTIONS.format(rubric=rubric)},
        {"role": "user", "content": text},
    ]
    return messages, len(bodies)


def parse_scores(content: str | None, count: int) -> list[TrajectoryScore]:
    """The judge's JSON answer as `count` scores in trajectory order; RulerError when it is not that."""
    try:
        parsed = JudgeResponse.model_validate_json(content or "")
    except pydantic.ValidationError as error:
        message = f"the judge's answer is not valid score JSON: {error}; answer: {content!r}"
        raise RulerError(message) from error
    if len(parsed.scores) != count:
        raise RulerError(f"the judge returned {len(parsed.scores)} scores for {count} trajectories")
    by_id = {score.trajectory_id: score for score in parsed.scores}
    ids = [str(i) for i in range(1, count + 1)]
    if set(by_id) == set(ids):
        return [by_id[i] for i in ids]
    return parsed.scores  # ids the judge renamed: its order is the trajectories' order, as in ART


def _judge_endpoint(judge_model: Any, client: AsyncOpenAI | None) -> tuple[AsyncOpenAI, str]:
    if isinstance(judge_model, str):
        return client or AsyncOpenAI(), judge_model
    # a served art-ray Model / TrainableModel: its own endpoint and (latest) name
    return client or judge_model.openai_client(), judge_model.get_inference_name()


async def ruler(
    message_lists: list[list[dict]],
    judge_model: Any = "gpt-4o-mini",
    *,
    client: AsyncOpenAI | None = None,
    rubric: str = DEFAULT_RUBRIC,
    extra_params: dict[str, Any] | None = None,
) -> list[TrajectoryScore]:
    """Score each message list in [0, 1] relative to the others; one judge call."""
    if not message_lists:
        return []
    messages, count = judge_messages(message_lists, rubric)
    endpoint, model_name = _judge_endpoint(judge_model, client)
    params: dict[str, Any] = {
        "temperature": 0.0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "ruler_scores", "schema": response_schema(count)},
        },
    }
    params.update(extra_params or {})
    completion = await endpoint.chat.completions.create(model=model_name, messages=messages, **params)
    if not completion.choices:
        raise RulerError("the judge returned no choices")
    scores = parse_scores(completion.choices[0].message.content, count)
    if count == 1 and len(message_lists) > 1:
        return [scores[0].model_copy(update={"trajectory_id": str(i + 1)}) for i in range(len(message_lists))]
    return scores


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: Any = "gpt-4o-mini",
    *,
    client: AsyncOpenAI | None = None,
    rubric: str = DEFAULT_RUBRIC,
    swallow_exceptions: bool = False,
    extra_params: dict[str, Any] | None = None,
) -> TrajectoryGroup | None:
    """A copy of the group rewarded by the judge: `reward` = judge score, the old reward in
    `metrics["independent_reward"]`, the explanation in `logs`. Plugs into
    `gather_trajectory_groups(after_each=lambda g: ruler_score_group(g, judge, swallow_exceptions=True))`;
    with `swallow_exceptions`, a failed judgement drops the group (None) instead of raising.
    """
    for trajectory in group.trajectories:
        if trajectory.additional_histories:
            raise RulerError("RULER does not score trajectories with additional_histories")
    try:
        scores = await ruler(
            [get_messages(t.messages_and_choices) for t in group.trajectories],
            judge_model,
            client=client,
            rubric=rubric,
            extra_params=extra_params,
        )
    except Exception as error:
        if swallow_exceptions:
            print(f"[RULER] group dropped: {error}", flush=True)
            return None
        raise
    judged: list[Trajectory] = []
    for trajectory, score in zip(group.trajectories, scores, strict=True):
        metrics = {**trajectory.metrics, "independent_reward": trajectory.reward, "ruler_score": score.score}
        logs = [*trajectory.logs, f"RULER explanation: {score.explanation}"]
        judged.append(trajectory.model_copy(update={"metrics": metrics, "logs": logs, "reward": score.score}))
    return TrajectoryGroup(judged, metadata=dict(group.metadata), exceptions=list(group.exceptions))
