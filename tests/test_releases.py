"""Releases without a cluster (art_ray/releases.py): sticky arm assignment, the always-valid comparison's
error rate over many looks, and a release's path through its stages to promotion or rollback."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from art_ray.access import AccessTable
from art_ray.releases import (
    ArmStats,
    Decision,
    Release,
    ReleasePolicy,
    ReleaseState,
    apply,
    decide,
    guardrail_values,
    start_canary,
)
from art_ray.serving.endpoint_guard import EndpointGuard
from art_ray.serving.middleware import ModelRoutingMiddleware

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import release_gate  # noqa: E402

POLICY = ReleasePolicy(min_feedback=30)
REPLY = {"message": {"role": "assistant", "content": "Sure."}, "finish_reason": "stop"}
CUT = {"message": {"role": "assistant", "content": "Sure, and"}, "finish_reason": "length"}


def test_a_user_keeps_one_arm_and_the_arms_get_their_shares() -> None:
    release = start_canary(
        Release(model="run", stable=3, policy=POLICY.model_copy(update={"holdout": 0.1})), 4
    )
    assert (release.candidate, release.share, release.holdout_step) == (4, 0.05, 3)
    users = [f"user-{i}" for i in range(20_000)]
    arms = Counter(release.arm_for(user, 0.0) for user in users)
    assert arms[4] / len(users) == pytest.approx(0.05 * 0.9, abs=0.006)  # the holdout's 10% aside
    assert all(release.arm_for(user, 0.99) == release.arm_for(user, 0.0) for user in users[:200])
    advanced = release.model_copy(update={"share": 0.5})
    moved = [u for u in users if release.arm_for(u, 0) == 4]
    assert all(advanced.arm_for(user, 0.0) == 4 for user in moved)  # a growing share keeps its users
    assert Release(model="run").arm_for("anyone", 0.3) is None  # no release: the newest served


def test_guardrails_read_the_served_choice() -> None:
    assert guardrail_values(REPLY) == {"empty": 0.0, "bad_tool_call": 0.0, "truncated": 0.0}
    assert guardrail_values(CUT)["truncated"] == 1.0
    assert guardrail_values({"message": {"content": ""}, "finish_reason": "stop"})["empty"] == 1.0
    call = {"function": {"name": "f", "arguments": "{not json"}}
    assert guardrail_values({"message": {"content": None, "tool_calls": [call]}})["bad_tool_call"] == 1.0


def simulate(seed: int, candidate_cut: float, candidate_score: float, looks: int = 400) -> tuple[str, int]:
    """A canary of step 1 against step 0, checked after every request (bench/release_gate.py's run): the
    outcome and the requests until it."""
    outcome, requests, _ = release_gate.run(seed, candidate_cut, candidate_score, looks, POLICY)
    return outcome, requests


def test_a_version_as_good_as_stable_is_rolled_back_less_often_than_alpha() -> None:
    outcomes = Counter(simulate(seed, 0.02, 0.5)[0] for seed in range(200))
    assert outcomes["rollback"] / 200 <= POLICY.alpha, outcomes


def test_a_version_that_cuts_its_replies_is_rolled_back_within_its_first_few_dozen_requests() -> None:
    results = [simulate(seed, 0.6, 0.5) for seed in range(30)]
    assert all(action == "rollback" for action, _ in results)
    # at a 5% share, about 10 of the candidate's turns: a few hundred requests in all
    assert sorted(look for _, look in results)[15] < 400


def test_a_good_version_advances_stage_by_stage_to_promotion() -> None:
    rng = random.Random(0)
    release = start_canary(Release(model="run", stable=0, policy=POLICY), 1)
    stats = {0: ArmStats(), 1: ArmStats()}
    shares = [release.share]
    for _ in range(20_000):
        arm = 1 if rng.random() < release.share else 0
        stats[arm].add_turn(REPLY)
        stats[arm].score.add(float(rng.random() < (0.7 if arm else 0.5)))
        release = apply(release, decide(release, stats))
        if release.share != shares[-1]:
            shares.append(release.share)
        if release.status == "promoted":
            break
    assert release.status == "promoted" and release.stable == 1 and release.candidate is None
    assert shares[:-1] == [0.05, 0.25, 0.5, 1.0][: len(shares) - 1]


def test_a_rollback_rejects_the_step_and_serves_stable_to_everyone() -> None:
    release = start_canary(Release(model="run", stable=2, policy=POLICY), 3)
    stats = {2: ArmStats(), 3: ArmStats()}
    for _ in range(40):
        stats[2].add_turn(REPLY)
        stats[3].add_turn(CUT)
    decision = decide(release, stats)
    assert decision.action == "rollback" and "truncated" in decision.reason
    rolled = apply(release, decision)
    assert (rolled.status, rolled.rejected, rolled.candidate) == ("rolled_back", (3,), None)
    assert {rolled.arm_for(f"u{i}", 0.5) for i in range(500)} == {2}


def test_stages_must_rise_to_all_traffic() -> None:
    for stages in ([0.5, 0.25, 1.0], [0.1, 0.5], [0.0, 1.0]):
        with pytest.raises(ValueError, match="stages"):
            ReleasePolicy(stages=stages)


# --- the endpoint's routing of a released run (the middleware with a stand-in for vLLM) ------------


class ServedSteps:
    """A replica serving run@1, run@2 and run@3."""

    def latest_step(self, model: str) -> int | None:
        return 3 if model == "run" else None

    def served_models(self) -> dict[str, list[int]]:
        return {"run": [1, 2, 3]}

    async def ensure(self, model: str, step: int) -> bool:
        return step in (1, 2, 3)


async def echo_model(scope, receive, send) -> None:  # noqa: ANN001
    request = json.loads((await receive())["body"])
    body = json.dumps({"model": request["model"], "choices": []}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


async def routed_to(release: Release | None, model: str = "run", **fields: object) -> str:
    access = AccessTable(releases={"run": release} if release is not None else {})
    routing = ModelRoutingMiddleware(echo_model, ServedSteps(), max_n=4, default_max_tokens=8)
    app = EndpointGuard(routing, api_key="admin", access=lambda: access)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer admin"}
        )
    assert response.status_code == 200, response.text
    return response.json()["model"]


async def test_the_endpoint_routes_a_bare_name_by_its_release() -> None:
    assert await routed_to(None) == "run@3"  # no release: the newest served
    assert await routed_to(Release(model="run", stable=1)) == "run@1"  # trained, not released
    canary = start_canary(
        Release(model="run", stable=1, policy=POLICY.model_copy(update={"stages": [0.5, 1.0]})), 3
    )
    users = [f"user-{i}" for i in range(16)]
    for user in users:
        assert await routed_to(canary, user=user) == f"run@{canary.arm_for(user, 0.0)}"
    anthropic_user = await routed_to(canary, metadata={"user_id": users[0]})
    assert anthropic_user == f"run@{canary.arm_for(users[0], 0.0)}"
    rolled = apply(canary, Decision(action="rollback", reason="by hand"))
    assert {await routed_to(rolled, user=user) for user in users} == {"run@1"}
    assert await routed_to(rolled, "run@3") == "run@3"  # pinned stays pinned
    # no stable step known: the newest served that was not rolled back
    assert await routed_to(Release(model="run", rejected=(3,))) == "run@2"


def test_the_release_gate_bench_runs_its_short_form() -> None:
    bench = Path(__file__).parents[1] / "bench" / "release_gate.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--seeds", "10", "--requests", "400"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "release_gate" and result["cuts_rollback_rate"] == 1.0
    assert result["good_rollback_rate"] <= 0.1


def test_each_online_step_logs_where_its_release_stood() -> None:
    """OnlineStep's MLflow row: the candidate's exposure, the rollbacks so far, each arm's mean score."""
    from art_ray.traffic.online import ReleaseMetrics

    assert ReleaseMetrics.of(ReleaseState(release=None)) is None
    release = start_canary(Release(model="run", stable=2, rejected=(1,)), 3)
    arms = {2: ArmStats(), 3: ArmStats()}
    for score in (1.0, 0.0, 1.0):
        arms[2].score.add(score)
    logged = ReleaseMetrics.of(ReleaseState(release=release, arms=arms)).metrics()  # type: ignore[union-attr]
    assert logged == {
        "release/share": 0.05,
        "release/rollbacks": 1.0,
        "release/stable_step": 2.0,
        "release/candidate_step": 3.0,
        "release/stable_score": pytest.approx(2 / 3),
    }  # the candidate has no score yet: no row rather than a 0
