"""Releases: a new version of a run first serves a share of its traffic, is compared with the stable
version on what its turns show, and is promoted or rolled back.

- `Release`: a run's arms: the stable step, the candidate step and its share, and a holdout kept on the
  version that was stable before the release began. A request for the bare `name` is assigned an arm by
  a sticky hash of who sent it (`arm_for`: the same user or session always gets the same version while
  the shares stand), so one user's feedback is about one version. `name@step` is never reassigned.
- `ArmStats`: per served version, running sums of the signals the comparison reads: the feedback score
  of each labeled turn (slow: it matures late) and guardrails measured on every turn as it is stored
  (fast): the reply was empty, a tool call's arguments were not JSON, the reply stopped at its token
  limit. Sums and sums of squares only: memory does not grow with traffic.
- `compare`: a confidence sequence for the difference of two arms' means (the mixture martingale that
  mSPRT inverts: Robbins 1970; Johari, Pekelis and Walsh, arXiv 1512.04922; Howard et al., arXiv
  1810.08240), valid at every look however often it looks, with error rate `alpha`. The candidate is
  worse when the whole interval lies below zero (below `-margin` for non-inferiority the other way).
- `decide`: the release's next move from the comparisons: roll back when any signal is worse, advance
  to the next stage when the feedback shows the candidate not worse by `margin` with at least
  `min_feedback` scores on each arm, else wait. Guardrails are "lower is better" rates; the score is
  "higher is better".

Plain pydantic and math: it crosses the registry to every replica and imports no ray or torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Literal

import pydantic

ReleaseStatus = Literal["stable", "canary", "paused", "promoted", "rolled_back"]
GUARDRAILS = ("empty", "bad_tool_call", "truncated")


class ReleasePolicy(pydantic.BaseModel):
    """How a run releases its new versions (`ModelConfig.release`). `stages`: the candidate's share of
    traffic at each stage, the last one 1.0; `holdout`: the share kept on the version stable before the
    release (a permanent comparison point; 0 for none); `min_feedback`: feedback scores on each arm
    before a stage advances; `margin`: how much worse in mean score a candidate may be and still advance;
    `alpha`: the release's error rate (a good version is rolled back with at most this probability,
    shared between its four signals); `prior_scale`: the mixture's scale, the size of difference the
    test is tuned to find."""

    model_config = pydantic.ConfigDict(extra="forbid")

    stages: list[float] = pydantic.Field(default_factory=lambda: [0.05, 0.25, 0.5, 1.0], min_length=1)
    holdout: float = pydantic.Field(default=0.02, ge=0, lt=0.5)
    min_feedback: int = pydantic.Field(default=30, ge=1)
    margin: float = pydantic.Field(default=0.05, ge=0)
    alpha: float = pydantic.Field(default=0.05, gt=0, lt=1)
    prior_scale: float = pydantic.Field(default=0.1, gt=0)

    @pydantic.field_validator("stages")
    @classmethod
    def _rising_to_all(cls, stages: list[float]) -> list[float]:
        if any(not 0 < share <= 1 for share in stages) or stages != sorted(stages) or stages[-1] != 1.0:
            raise ValueError("stages are rising shares in (0, 1], the last one 1.0")
        return stages


class Release(pydantic.BaseModel):
    """A run's arms as every replica routes them. `stable`: the step most traffic gets (None: the
    newest served, as without a release); `candidate` and `share`: the version under test and its share;
    `holdout_step` and `holdout`: the comparison point kept aside; `rejected`: steps rolled back, never
    served to `name` again; `policy`: how the release moves (the run's `ModelConfig.release`)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    model: str
    stable: int | None = None
    candidate: int | None = None
    share: float = pydantic.Field(default=0.0, ge=0, le=1)
    stage: int = 0
    holdout_step: int | None = None
    holdout: float = pydantic.Field(default=0.0, ge=0, lt=1)
    status: ReleaseStatus = "stable"
    rejected: tuple[int, ...] = ()
    reason: str = ""
    policy: ReleasePolicy = pydantic.Field(default_factory=lambda: ReleasePolicy())

    def arm_for(self, sticky: str | None, fallback: float) -> int | None:
        """The step for a request from `sticky` (a user or session id; None: `fallback`, a uniform draw in
        [0, 1), per request). None: the newest served version."""
        u = _unit_hash(self.model, sticky) if sticky is not None else fallback
        if self.holdout_step is not None and u < self.holdout:
            return self.holdout_step
        rest = (u - self.holdout) / (1 - self.holdout) if u >= self.holdout else u
        if self.candidate is not None and self.status == "canary" and rest < self.share:
            return self.candidate
        return self.stable

    def arms(self) -> dict[str, int]:
        """The steps being compared, by arm name."""
        named = {"stable": self.stable, "candidate": self.candidate, "holdout": self.holdout_step}
        return {arm: step for arm, step in named.items() if step is not None}


def _unit_hash(model: str, sticky: str) -> float:
    digest = hashlib.sha256(f"{model}\0{sticky}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class Moments(pydantic.BaseModel):
    """Count, sum and sum of squares of one signal on one arm."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.squares += value * value

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def variance(self) -> float:
        if self.n < 2:
            return 0.0
        return max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))


class ArmStats(pydantic.BaseModel):
    """One served version's signals: feedback scores (one per labeled turn) and the guardrails of every
    stored turn."""

    turns: int = 0
    score: Moments = pydantic.Field(default_factory=Moments)
    guardrails: dict[str, Moments] = pydantic.Field(default_factory=dict)

    def add_turn(self, choice: dict) -> None:
        self.turns += 1
        for name, value in guardrail_values(choice).items():
            self.guardrails.setdefault(name, Moments()).add(value)


def guardrail_values(choice: dict) -> dict[str, float]:
    """A served choice's guardrail indicators (1.0 when tripped): an empty reply (no text, no tool call),
    a tool call whose arguments are not a JSON object, a reply cut at its token limit."""
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content) if content else ""
    bad_call = 0.0
    for call in calls:
        try:
            arguments = json.loads((call.get("function") or {}).get("arguments") or "")
        except (ValueError, TypeError, AttributeError):
            arguments = None
        if not isinstance(arguments, dict):
            bad_call = 1.0
    return {
        "empty": float(not text.strip() and not calls),
        "bad_tool_call": bad_call,
        "truncated": float(choice.get("finish_reason") == "length"),
    }


class Interval(pydantic.BaseModel):
    """An always-valid confidence interval for mean(candidate) - mean(baseline)."""

    low: float
    high: float
    difference: float
    n_candidate: int
    n_baseline: int


# below this many values on either arm a signal is not compared: the normal approximation needs them
MIN_SAMPLES = 10
# a variance floor: arms that so far agree exactly (a guardrail that never tripped) keep a finite interval
_VARIANCE_FLOOR = 1e-4


def compare(candidate: Moments, baseline: Moments, alpha: float, prior_scale: float) -> Interval | None:
    """The mixture confidence sequence for the difference in means, valid at every look (None until each
    arm has MIN_SAMPLES values). The variance is the two arms' pooled one, the right one while they do
    not differ (a candidate's few first values, all alike, would otherwise read as certain). With V the
    difference's variance and tau the prior scale, the interval holds every theta whose mixture likelihood
    ratio stays below 1/alpha: |difference - theta| <= sqrt(2 V (V + tau^2) / tau^2 * (log(1/alpha) +
    log((V + tau^2) / V) / 2))."""
    if candidate.n < MIN_SAMPLES or baseline.n < MIN_SAMPLES:
        return None
    pooled = Moments(
        n=candidate.n + baseline.n,
        total=candidate.total + baseline.total,
        squares=candidate.squares + baseline.squares,
    )
    variance = max(pooled.variance, _VARIANCE_FLOOR) * (1 / candidate.n + 1 / baseline.n)
    tau2 = prior_scale * prior_scale
    log_term = math.log(1 / alpha) + 0.5 * math.log((variance + tau2) / variance)
    radius = math.sqrt(2 * variance * (variance + tau2) / tau2 * log_term)
    difference = candidate.mean - baseline.mean
    return Interval(
        low=difference - radius,
        high=difference + radius,
        difference=difference,
        n_candidate=candidate.n,
        n_baseline=baseline.n,
    )


class Decision(pydantic.BaseModel):
    """What a release does next, and why."""

    action: Literal["wait", "advance", "promote", "rollback"]
    reason: str
    intervals: dict[str, Interval] = pydantic.Field(default_factory=dict)


def decide(release: Release, stats: dict[int, ArmStats]) -> Decision:
    """Compare the candidate with the stable version: any guardrail higher or the score lower (the whole
    interval past zero) rolls back; at the last stage a score not worse by `margin` promotes, before it
    advances the stage; otherwise wait."""
    if release.status != "canary" or release.candidate is None or release.stable is None:
        return Decision(action="wait", reason=f"no canary ({release.status})")
    policy = release.policy
    candidate, stable = stats.get(release.candidate, ArmStats()), stats.get(release.stable, ArmStats())
    alpha = policy.alpha / (
        len(GUARDRAILS) + 1
    )  # each signal's share: a good version's rollback rate <= alpha
    intervals: dict[str, Interval] = {}
    for name in GUARDRAILS:
        interval = compare(
            candidate.guardrails.get(name, Moments()),
            stable.guardrails.get(name, Moments()),
            alpha,
            policy.prior_scale,
        )
        if interval is None:
            continue
        intervals[name] = interval
        if interval.low > 0:
            reason = (
                f"{name} rate {interval.difference:+.3f} against step {release.stable} "
                f"(interval low {interval.low:+.3f} > 0)"
            )
            return Decision(action="rollback", reason=reason, intervals=intervals)
    score = compare(candidate.score, stable.score, alpha, policy.prior_scale)
    if score is not None:
        intervals["score"] = score
        if score.high < 0:
            reason = (
                f"score {score.difference:+.3f} against step {release.stable} "
                f"(interval high {score.high:+.3f} < 0)"
            )
            return Decision(action="rollback", reason=reason, intervals=intervals)
    enough = min(candidate.score.n, stable.score.n) >= policy.min_feedback
    if score is not None and enough and score.low > -policy.margin:
        action = "promote" if release.stage >= len(policy.stages) - 1 else "advance"
        reason = (
            f"score {score.difference:+.3f}, not worse than -{policy.margin} (interval low {score.low:+.3f})"
        )
        return Decision(action=action, reason=reason, intervals=intervals)
    have = min(candidate.score.n, stable.score.n)
    return Decision(
        action="wait", reason=f"{have} of {policy.min_feedback} scores on each arm", intervals=intervals
    )


def apply(release: Release, decision: Decision) -> Release:
    """The release after `decision`."""
    policy = release.policy
    if decision.action == "rollback":
        assert release.candidate is not None
        return release.model_copy(
            update={
                "candidate": None,
                "share": 0.0,
                "status": "rolled_back",
                "rejected": (*release.rejected, release.candidate),
                "reason": decision.reason,
            }
        )
    if decision.action == "promote":
        return release.model_copy(
            update={
                "stable": release.candidate,
                "candidate": None,
                "share": 0.0,
                "status": "promoted",
                "reason": decision.reason,
            }
        )
    if decision.action == "advance":
        stage = min(release.stage + 1, len(policy.stages) - 1)
        return release.model_copy(
            update={"stage": stage, "share": policy.stages[stage], "reason": decision.reason}
        )
    return release


def start_canary(release: Release, step: int) -> Release:
    """`step` becomes the candidate at the first stage; the holdout keeps the stable step of the moment
    the first release began."""
    policy = release.policy
    holdout_step = release.holdout_step if release.holdout_step is not None else release.stable
    return release.model_copy(
        update={
            "candidate": step,
            "share": policy.stages[0],
            "stage": 0,
            "status": "canary",
            "holdout_step": holdout_step if policy.holdout > 0 else None,
            "holdout": policy.holdout if holdout_step is not None else 0.0,
            "reason": f"step {step} released to {policy.stages[0]:.0%}",
        }
    )


ReleaseVerb = Literal["status", "start", "check", "promote", "rollback", "pause", "resume"]


class ReleaseAction(pydantic.BaseModel):
    """What to do with a run's release. `start`: `step` (default: the newest published) becomes the
    candidate at the first stage; `check`: compare the arms and move (roll back, advance, promote) or
    wait; `promote` / `rollback`: by hand, now; `pause`: every request to the stable step, the candidate
    kept; `resume`: back to the candidate's share."""

    model_config = pydantic.ConfigDict(extra="forbid")

    action: ReleaseVerb = "status"
    # strict: JSON's `false` is not step 0 (bench/fuzz.py found it accepted)
    step: int | None = pydantic.Field(default=None, ge=0, strict=True)
    reason: str = pydantic.Field(default="", max_length=1024)


class ReleaseState(pydantic.BaseModel):
    """A run's release and the evidence per served step (None: the run has no release)."""

    release: Release | None
    arms: dict[int, ArmStats] = pydantic.Field(default_factory=dict)
    decision: Decision | None = None


def format_release(state: ReleaseState) -> str:
    """A release and its evidence, as `art-ray release` and `art-ray status` print them."""
    release = state.release
    if release is None:
        return "no release (the newest version serves every request)"
    lines = [f"{release.model}: {describe(release)}"]
    if release.reason:
        lines.append(f"  last move: {release.reason}")
    for step, arm in sorted(state.arms.items()):
        trips = ", ".join(f"{name} {moments.mean:.3f}" for name, moments in sorted(arm.guardrails.items()))
        score = f"score {arm.score.mean:.3f} over {arm.score.n}" if arm.score.n else "no scores"
        lines.append(f"  step {step}: {arm.turns} turns, {score}; {trips}")
    if state.decision is not None:
        lines.append(f"  next: {state.decision.action} ({state.decision.reason})")
    return "\n".join(lines)


def describe(release: Release) -> str:
    """One line: the status and the arms."""
    text = f"{release.status}, stable step {release.stable}"
    if release.candidate is not None:
        text += f", candidate step {release.candidate} at {release.share:.0%}"
    if release.holdout_step is not None and release.holdout:
        text += f", holdout step {release.holdout_step} at {release.holdout:.0%}"
    if release.rejected:
        text += f", rolled back {list(release.rejected)}"
    return text
