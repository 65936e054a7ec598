"""Continuous training from a run's own traffic: the labeled turns its traffic log hands out become
groups (art_ray/traffic/groups.py) and train the run, step after step, while the endpoint keeps serving.

Each step takes the turns whose first feedback came since the last step (`TrafficLog.matured`), drops the
stale ones, those sampled more than `max_steps_off_policy` trained steps ago or served more than
`max_age_s` ago (the ratio against their sampling logprobs is exact, but its variance grows with the
lag), and trains the rest with truncated importance sampling (TrainConfig.truncated_importance_sampling,
2 by default: verl's and Agent Lightning's threshold).

Exactly once: where the run stands (the cursor past the last turn taken, each task's running mean,
counters) is written to `online/{step}.json` before the step that would reach it is trained. A restarted
trainer reads the file of the model's step, the newest complete checkpoint: a step that failed or never
finished leaves a file of a step the model does not have, which is ignored, and its turns are taken
again. A batch with nothing to train (every turn stale, or the first of its task) moves the cursor in the
current step's file.
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import time
from typing import TYPE_CHECKING

import pydantic

from art_ray.releases import Decision, ReleaseState
from art_ray.storage import resolve_filesystem as storage_filesystem
from art_ray.traffic.groups import TaskBaselines, TrafficGrouping, traffic_groups
from art_ray.traffic.records import LabeledTurn, MaturedTraffic, TrafficCursor
from art_ray.train_config import TrainConfig

if TYPE_CHECKING:
    from art_ray.model import TrainableModel

STATE_FOLDER = "online"


def _default_train_config() -> TrainConfig:
    # centred rewards (a running mean has no std of the group) and off-policy weights cut at 2
    return TrainConfig(scale_rewards=False, truncated_importance_sampling=2.0)


class OnlineTrainConfig(pydantic.BaseModel):
    """How a run trains on its traffic. `min_turns`: labeled turns that make a step (fewer wait for more);
    `max_turns`: the most one step takes; `poll_s`: how often `run` asks for new ones;
    `max_steps_off_policy` / `max_age_s`: the staleness bounds, in trained steps and in seconds since the
    turn was served; `baseline_window`: the rewards a task's running mean averages (TaskMean);
    `train`: each step's TrainConfig. With a release (ModelConfig.release), training waits while it is
    `max_steps_off_policy` steps past the stable step, which serves most turns, until a release moves."""

    model_config = pydantic.ConfigDict(extra="forbid")

    min_turns: int = pydantic.Field(default=8, ge=1)
    max_turns: int = pydantic.Field(default=64, ge=1)
    poll_s: float = pydantic.Field(default=5.0, gt=0)
    max_steps_off_policy: int = pydantic.Field(default=4, ge=0)
    max_age_s: float = pydantic.Field(default=86400.0, gt=0)
    baseline_window: int = pydantic.Field(default=32, ge=1)
    train: TrainConfig = pydantic.Field(default_factory=_default_train_config)


class OnlineState(pydantic.BaseModel):
    """Where a run's training on its traffic stands after `step`."""

    step: int = 0
    cursor: TrafficCursor | None = None
    baselines: TaskBaselines = pydantic.Field(default_factory=TaskBaselines)
    turns_trained: int = 0
    turns_stale: int = 0
    turns_first_of_task: int = 0


class ReleaseMetrics(pydantic.BaseModel):
    """A release at one training step, as MLflow gets it: the candidate's share of traffic (its
    exposure), the rollbacks so far, and the mean feedback score served by each arm (None: no score)."""

    stable: int | None
    candidate: int | None
    share: float
    rollbacks: int
    stable_score: float | None
    candidate_score: float | None

    @staticmethod
    def of(state: ReleaseState) -> ReleaseMetrics | None:
        release = state.release
        if release is None:
            return None

        def score(step: int | None) -> float | None:
            arm = state.arms.get(step) if step is not None else None
            return arm.score.mean if arm is not None and arm.score.n else None

        return ReleaseMetrics(
            stable=release.stable,
            candidate=release.candidate,
            share=release.share,
            rollbacks=len(release.rejected),
            stable_score=score(release.stable),
            candidate_score=score(release.candidate),
        )

    def metrics(self) -> dict[str, float]:
        values = {"release/share": self.share, "release/rollbacks": self.rollbacks}
        for name, value in (
            ("release/stable_step", self.stable),
            ("release/candidate_step", self.candidate),
            ("release/stable_score", self.stable_score),
            ("release/candidate_score", self.candidate_score),
        ):
            if value is not None:
                values[name] = value
        return {name: float(value) for name, value in values.items()}


class OnlineStep(pydantic.BaseModel):
    """One batch of labeled turns and what became of it (logged to MLflow as `traffic/*`)."""

    step: int  # the step trained, or the current one when nothing was
    trained: bool
    turns: int
    stale: int
    groups: int
    grouping: TrafficGrouping
    reward: float  # the batch's mean feedback score: the reward served, as users scored it
    feedback_delay_s: float  # mean, serving to first feedback
    steps_off_policy_mean: float
    steps_off_policy_max: int
    coverage: float | None  # labeled / (labeled + unlabeled) among retained turns
    seconds: float
    release: ReleaseMetrics | None = None  # with ModelConfig.release: where it stood at this step

    def metrics(self) -> dict[str, float]:
        values = {
            "traffic/turns": self.turns,
            "traffic/turns_stale": self.stale,
            "traffic/groups": self.groups,
            "traffic/reward": self.reward,
            "traffic/feedback_delay_s": self.feedback_delay_s,
            "traffic/steps_off_policy_mean": self.steps_off_policy_mean,
            "traffic/steps_off_policy_max": self.steps_off_policy_max,
            "traffic/first_of_task": self.grouping.first_of_task,
            "traffic/step_seconds": self.seconds,
        }
        if self.coverage is not None:
            values["traffic/feedback_coverage"] = self.coverage
        if self.release is not None:
            values.update(self.release.metrics())
        return {name: float(value) for name, value in values.items()}


def _policy_version(labeled: LabeledTurn) -> int | None:
    version = labeled.stored.turn.choice.get("policy_version")
    return version if isinstance(version, int) else None


class OnlineTrainer:
    """Trains `model` on its labeled traffic: `step()` once, `run()` until stopped. The model must store
    its traffic (ModelConfig.traffic). `state_dir`: where the per-step state goes (the model's folder for
    a RayBackend, `./.art_ray/{project}/{name}/online` otherwise)."""

    def __init__(
        self, model: TrainableModel, config: OnlineTrainConfig | None = None, state_dir: str | None = None
    ) -> None:
        if model.config.traffic is None:
            raise ValueError(f"model {model.name!r} stores no traffic: set ModelConfig.traffic")
        self.model = model
        self.config = config or OnlineTrainConfig()
        self.state_dir = state_dir or self._default_state_dir()
        self.state: OnlineState | None = None
        self.reports: list[OnlineStep] = []
        self.release_decisions: list[Decision] = []  # every release move check_release made
        self._stop = False

    def request_stop(self) -> None:
        """Stop `run` after the step in flight (or at once when none is)."""
        self._stop = True

    async def run(self, max_steps: int | None = None) -> list[OnlineStep]:
        """Train a step whenever `min_turns` labeled turns are waiting, until `request_stop()` or
        `max_steps` trained steps; returns every batch's report."""
        trained = 0
        while not self._stop and (max_steps is None or trained < max_steps):
            if self.model.config.release is not None:
                await self.check_release()
            report = await self.step()
            if report is None:
                await asyncio.sleep(self.config.poll_s)
                continue
            trained += report.trained
        return self.reports

    async def check_release(self) -> Decision | None:
        """Compare the canary with the stable step and move it (ModelConfig.release): roll back, advance,
        promote, or wait; after a promotion or rollback, the newest trained step is the next canary.
        None when nothing was compared."""
        state = await self.model.release()
        if state.release is None:
            return None
        if state.release.status == "canary":
            decided = await self.model.release("check")
            if decided.decision is not None and decided.decision.action != "wait":
                self.release_decisions.append(decided.decision)
            return decided.decision
        newest = await self.model.get_step()
        release = state.release
        if release.status != "paused" and newest not in (release.stable, *release.rejected):
            await self.model.release("start", newest)
        return None

    async def step(self, force: bool = False) -> OnlineStep | None:
        """Take the labeled turns since the last step and train on them; None when fewer than `min_turns`
        are waiting (`force`: take however many there are, one at least)."""
        started = time.monotonic()
        state = await self._current_state()
        release_state = await self.model.release() if self.model.config.release is not None else None
        release = release_state.release if release_state is not None else None
        ahead = state.step - release.stable if release is not None and release.stable is not None else 0
        if ahead >= max(1, self.config.max_steps_off_policy):
            return None  # most turns come from the stable step: a step further would make them stale
        matured = await self.model.matured_traffic(state.cursor, self.config.max_turns)
        if not matured.turns or (len(matured.turns) < self.config.min_turns and not force):
            return None
        current = state.step
        fresh, stale, lags = self._fresh(matured, current)
        baselines = copy.deepcopy(state.baselines)
        groups, grouping = traffic_groups(
            fresh, baselines, frozenset(release.rejected) if release else frozenset()
        )
        after = OnlineState(
            step=current,
            cursor=matured.cursor,
            baselines=baselines,
            turns_trained=state.turns_trained + grouping.trajectories,
            turns_stale=state.turns_stale + stale,
            turns_first_of_task=state.turns_first_of_task + grouping.first_of_task,
        )
        trainable = any(group.has_signal for group in groups)
        if trainable:
            after.step = current + 1
            self._save(after)  # before the step: its checkpoint is what makes this file count
            step = await self.model.train(groups, self.config.train, verbose=False)
            if step != after.step:  # another caller trained the model meanwhile: file it under its step
                after.step = step
                self._save(after)
            if release is not None and release.status not in ("canary", "paused"):
                await self.model.release("start", step)  # a canary runs one at a time
        else:
            self._save(after)
        self.state = after
        report = OnlineStep(
            step=after.step,
            trained=trainable,
            turns=len(matured.turns),
            stale=stale,
            groups=len(groups),
            grouping=grouping,
            reward=statistics.fmean(labeled.reward for labeled in matured.turns),
            feedback_delay_s=statistics.fmean(labeled.delay_s for labeled in matured.turns),
            steps_off_policy_mean=statistics.fmean(lags) if lags else 0.0,
            steps_off_policy_max=max(lags, default=0),
            coverage=matured.coverage,
            seconds=time.monotonic() - started,
            release=ReleaseMetrics.of(release_state) if release_state is not None else None,
        )
        self.reports.append(report)
        await self.model.log(groups, split="traffic", metrics=report.metrics())
        return report

    # --- inside ---------------------------------------------------------------------------------

    def _fresh(self, matured: MaturedTraffic, current: int) -> tuple[list[LabeledTurn], int, list[int]]:
        """The turns inside both staleness bounds, how many were not, and the fresh ones' lags in steps."""
        oldest = time.time() - self.config.max_age_s
        fresh, lags = [], []
        for labeled in matured.turns:
            version = _policy_version(labeled)
            lag = current - version if version is not None else 0
            if lag > self.config.max_steps_off_policy or labeled.stored.turn.created_at < oldest:
                continue
            fresh.append(labeled)
            lags.append(lag)
        return fresh, len(matured.turns) - len(fresh), lags

    async def _current_state(self) -> OnlineState:
        """The state of the model's step: its file, else the newest earlier one (a step trained by another
        caller, or one whose file was lost), else a fresh start. A file of a later step is of a step that
        did not finish: its turns are taken again."""
        from art_ray import storage

        step = await self.model.get_step()
        if self.state is not None and self.state.step == step:
            return self.state
        saved = [saved for saved in self._saved_steps() if saved <= step]
        if saved:
            state = OnlineState.model_validate_json(storage.read_text(self._path(max(saved))))
            self.state = state.model_copy(update={"step": step})
        else:
            self.state = OnlineState(step=step)
        return self.state

    def _saved_steps(self) -> list[int]:
        import pyarrow.fs as pafs

        filesystem, inner = storage_filesystem(self.state_dir)
        infos = filesystem.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
        names = [info.base_name.removesuffix(".json") for info in infos if info.base_name.endswith(".json")]
        return [int(name) for name in names if name.isdigit()]

    def _save(self, state: OnlineState) -> None:
        from art_ray import storage

        storage.write_text(self._path(state.step), state.model_dump_json())

    def _path(self, step: int) -> str:
        return f"{self.state_dir}/{step:06d}.json"

    def _default_state_dir(self) -> str:
        backend = self.model.backend
        if getattr(backend, "storage", None) is not None:  # a RayBackend: beside the checkpoints
            return f"{backend.model_dir(self.model)}/{STATE_FOLDER}"
        return os.path.join(".art_ray", self.model.project, self.model.name, STATE_FOLDER)
