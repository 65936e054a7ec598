"""RULER: the judge's prompt, mapping its answer to rewards, bad answers, and a real served judge."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from art_ray import Trajectory, TrajectoryGroup, gather_trajectory_groups
from art_ray.rewards import RulerError, ruler, ruler_score_group
from art_ray.rewards.ruler import judge_messages, parse_scores, response_schema

SYSTEM = {"role": "system", "content": "Answer with one word."}
USER = {"role": "user", "content": "What color is the sky?"}


def conversation(answer: str) -> list[dict]:
    return [SYSTEM, USER, {"role": "assistant", "content": answer}]


def group(*answers: str) -> TrajectoryGroup:
    return TrajectoryGroup(
        Trajectory(messages_and_choices=conversation(a), reward=0.25 * i, metrics={"len": float(len(a))})
        for i, a in enumerate(answers)
    )


def answer(*scores: float, ids: list[str] | None = None) -> str:
    ids = ids or [str(i) for i in range(1, len(scores) + 1)]
    return json.dumps(
        {
            "scores": [
                {"trajectory_id": i, "explanation": f"e{i}", "score": s}
                for i, s in zip(ids, scores, strict=True)
            ]
        }
    )


class FakeJudge:
    """An AsyncOpenAI stand-in that records the request and returns a fixed answer (pure-logic tests)."""

    def __init__(self, content: str) -> None:
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        self._content = content

    async def _create(self, **request):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=self._content))])


def test_the_common_prefix_is_sent_once_and_each_remainder_apart() -> None:
    messages, count = judge_messages([conversation("Blue"), conversation("The sky is blue")])
    assert count == 2 and messages[0]["role"] == "system" and "Grading standards" in messages[0]["content"]
    text = messages[1]["content"]
    assert text.startswith(f"<context>\n{json.dumps([SYSTEM, USER])}\n</context>")
    assert text.count("What color is the sky?") == 1
    assert '<trajectory id="1">\n[{"role": "assistant", "content": "Blue"}]' in text
    assert '<trajectory id="2">\n[{"role": "assistant", "content": "The sky is blue"}]' in text


def test_identical_trajectories_are_judged_once_and_share_the_score() -> None:
    messages, count = judge_messages([conversation("Blue")] * 3)
    assert count == 1 and "<context>" not in messages[1]["content"]
    assert response_schema(3)["properties"]["scores"]["minItems"] == 3


def test_scores_map_by_id_and_bad_answers_raise() -> None:
    assert [s.score for s in parse_scores(answer(0.2, 0.9, ids=["2", "1"]), 2)] == [0.9, 0.2]
    with pytest.raises(RulerError, match="returned 1 scores for 2"):
        parse_scores(answer(0.5), 2)
    with pytest.raises(RulerError, match="not valid score JSON"):
        parse_scores("{'scores': nope", 2)
    with pytest.raises(RulerError, match="not valid score JSON"):
        parse_scores(answer(0.5, 1.5), 2)  # outside [0, 1]


async def test_ruler_score_group_moves_rewards_and_keeps_the_original() -> None:
    original = group("Blue", "The sky is blue today", "Green")
    judge = FakeJudge(answer(1.0, 0.4, 0.0))
    judged = await ruler_score_group(original, "judge", client=judge)
    assert judged.rewards == [1.0, 0.4, 0.0]
    assert [t.metrics["independent_reward"] for t in judged] == [0.0, 0.25, 0.5]
    assert [t.metrics["len"] for t in judged] == [4.0, 21.0, 5.0]
    assert judged.trajectories[1].logs[-1] == "RULER explanation: e2"
    assert original.rewards == [0.0, 0.25, 0.5]  # the input group is left as it was
    request = judge.requests[0]
    assert request["model"] == "judge"
    assert request["response_format"]["json_schema"]["schema"] == response_schema(3)


async def test_a_failed_judgement_raises_or_drops_the_group() -> None:
    with pytest.raises(RulerError):
        await ruler_score_group(group("a", "b"), "judge", client=FakeJudge(answer(0.1)))
    failing = FakeJudge("nope")
    assert await ruler_score_group(group("a", "b"), "j", client=failing, swallow_exceptions=True) is None

    # as after_each: the group whose judgement fails is dropped, the other is rewarded by the judge
    def judge_for(trajectory_group: TrajectoryGroup) -> FakeJudge:
        first = trajectory_group.trajectories[0].messages_and_choices[-1]["content"]
        return FakeJudge(answer(0.3, 0.7) if first == "a" else "not json")

    gathered = await gather_trajectory_groups(
        [group("a", "b"), group("c", "d")],
        after_each=lambda g: ruler_score_group(g, "j", client=judge_for(g), swallow_exceptions=True),
        pbar_desc=None,
    )
    assert [g.rewards for g in gathered] == [[0.3, 0.7]]


@pytest.mark.slow
async def test_the_served_model_judges_with_structured_output(smollm2_model) -> None:
    # a served TrainableModel as the judge: its own endpoint and latest version
    scores = await ruler(
        [conversation("Blue"), conversation("The sky is green and also purple")],
        smollm2_model.model,
        extra_params={"max_tokens": 300},
    )
    assert [s.trajectory_id for s in scores] == ["1", "2"]
    assert all(0.0 <= s.score <= 1.0 for s in scores)
