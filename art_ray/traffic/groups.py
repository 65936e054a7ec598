"""Labeled traffic -> GRPO groups: turns grouped by task, each compared with a running mean of its task.

Production prompts rarely repeat, so a group of samples of one prompt, GRPO's comparison, seldom exists.
Turns are grouped by a task key instead: the request's `metadata["task"]` when the client names one (as
OpenPipe's `prompt_id`), else a hash of the system prompt and the tools (a templated agent's identity).
Each group's trajectories are compared with the running mean of its task's earlier rewards
(`TrajectoryGroup.baseline`: advantage = reward - mean, SPO's per-prompt value tracker, REINFORCE++'s
global baseline), so a turn trains alone. A task seen for the first time has no mean yet: two or more
of its turns compare with each other (the group's own mean); a lone first turn only starts the mean.

The means are the consumer's state (art_ray/traffic/online.py saves them with each trained step). Plain
Python and pydantic: no torch or ray.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict

import pydantic

from art_ray.capture.assemble import build_trajectory
from art_ray.capture.turns import CapturedTurn
from art_ray.errors import CaptureError
from art_ray.traffic.records import LabeledTurn
from art_ray.trajectories import TrajectoryGroup

TASK_METADATA_KEY = "task"


def task_key(turn: CapturedTurn) -> str:
    """`metadata["task"]` when the request named one, else `prompt:` and a hash of its system prompt(s)
    and tools (a turn with neither: the empty prompt's hash, one task for all)."""
    if turn.metadata and turn.metadata.get(TASK_METADATA_KEY):
        return "task:" + turn.metadata[TASK_METADATA_KEY]
    system = [m.get("content") for m in turn.request_messages if m.get("role") in ("system", "developer")]
    identity = json.dumps([system, turn.tools], sort_keys=True, default=str)
    return "prompt:" + hashlib.sha256(identity.encode()).hexdigest()[:16]


class TaskMean(pydantic.BaseModel):
    """A task's running mean reward: the plain mean of its first `window` rewards, then an exponential
    mean of weight 1/window (recent rewards count more as the policy improves)."""

    mean: float = 0.0
    count: int = 0

    def add(self, reward: float, window: int) -> None:
        self.count += 1
        self.mean += (reward - self.mean) / min(self.count, window)


class TaskBaselines(pydantic.BaseModel):
    """The running mean reward of each task key seen."""

    window: int = pydantic.Field(default=32, ge=1)
    tasks: dict[str, TaskMean] = pydantic.Field(default_factory=dict)

    def baseline(self, key: str) -> float | None:
        known = self.tasks.get(key)
        return known.mean if known is not None and known.count else None

    def add(self, key: str, reward: float) -> None:
        self.tasks.setdefault(key, TaskMean()).add(reward, self.window)


class TrafficGrouping(pydantic.BaseModel):
    """What one batch of labeled turns became."""

    groups: int = 0
    trajectories: int = 0
    against_baseline: int = 0  # groups compared with their task's running mean
    first_of_task: int = 0  # lone first turns of a task: they start its mean, no advantage yet
    unbuildable: int = 0  # turns whose record is not a trainable conversation (CaptureError)
    tasks: int = 0


def traffic_groups(
    turns: list[LabeledTurn], baselines: TaskBaselines, rejected: frozenset[int] = frozenset()
) -> tuple[list[TrajectoryGroup], TrafficGrouping]:
    """One group per task key among `turns` (in their order), each compared with its task's mean before
    this batch; then every reward joins its task's mean. `baselines` is updated in place. A turn sampled
    by a step in `rejected` (rolled back by its release) is tagged `rejected_version` in its metadata."""
    by_task: dict[str, list[LabeledTurn]] = defaultdict(list)
    for labeled in turns:
        by_task[task_key(labeled.stored.turn)].append(labeled)
    report = TrafficGrouping(tasks=len(by_task))
    groups = []
    for key, members in by_task.items():
        trajectories = []
        for labeled in members:
            try:
                trajectory = build_trajectory([labeled.stored.turn], labeled.reward)
            except CaptureError:
                report.unbuildable += 1
                continue
            trajectory.metadata.update(completion_id=labeled.stored.completion_id, task=key)
            if labeled.stored.turn.choice.get("policy_version") in rejected:
                trajectory.metadata["rejected_version"] = True
            trajectories.append(trajectory)
        baseline = baselines.baseline(key)
        for labeled in members:
            baselines.add(key, labeled.reward)
        if not trajectories:
            continue
        if baseline is None and len(trajectories) < 2:
            report.first_of_task += 1
            continue
        groups.append(TrajectoryGroup(trajectories, metadata={"task": key}, baseline=baseline))
        report.groups += 1
        report.trajectories += len(trajectories)
        report.against_baseline += baseline is not None
    return groups, report
