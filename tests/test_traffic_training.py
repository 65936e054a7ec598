"""From stored traffic to training, without Ray: the log's labeled turns in the order their feedback came
(art_ray/traffic/log.py `matured`), task keys and running-mean baselines (art_ray/traffic/groups.py), and
OnlineTrainer's cursor, staleness bounds and exactly-once state (art_ray/traffic/online.py) against a real
TrafficLog and a small stand-in for the model's train call. The real stack runs in test_sdk.py."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from art_ray.capture.turns import CapturedTurn
from art_ray.feedback import Feedback, TrafficConfig, request_metadata
from art_ray.traffic.groups import TaskBaselines, TaskMean, task_key, traffic_groups
from art_ray.traffic.log import TrafficLog
from art_ray.traffic.online import OnlineTrainConfig, OnlineTrainer
from art_ray.traffic.records import StoredTurn, TrafficCursor
from art_ray.trainer.batches import group_advantages
from art_ray.trajectories import TrajectoryGroup

SYSTEM = {"role": "system", "content": "You answer in one word."}


def served(
    completion_id: str,
    *,
    version: int = 0,
    served_at: float | None = None,
    task: str | None = None,
    system: dict | None = SYSTEM,
    tools: list | None = None,
) -> StoredTurn:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "yes"},
        "finish_reason": "stop",
        "logprobs": {"content": [{"token": "yes", "logprob": -0.5, "bytes": None, "top_logprobs": []}]},
        "token_ids": [7],
        "prompt_token_ids": [1, 2, 3],
        "policy_version": version,
        "sampling_params": {"temperature": 1.0},
    }
    messages = [m for m in (system, {"role": "user", "content": f"question {completion_id}"}) if m]
    turn = CapturedTurn(
        request_messages=messages,
        tools=tools,
        choice=choice,
        model=f"run@{version}",
        created_at=served_at or time.time(),
        completion_id=completion_id,
        metadata={"task": task} if task else None,
    )
    return StoredTurn(turn=turn)


def rate(log: TrafficLog, completion_id: str, value: float) -> None:
    assert log.add_feedback(Feedback(completion_id=completion_id, score=value), completion_id).status == 200
    time.sleep(0.002)  # distinct arrival times: the order of first feedback is the order of these calls


# --- the log's labeled turns ---------------------------------------------------------------------


def test_labeled_turns_come_in_the_order_of_their_first_feedback_and_once_past_a_cursor(
    tmp_path: Path,
) -> None:
    log = TrafficLog("run", str(tmp_path), TrafficConfig(flush_turns=2, mature_after_s=60))
    for name in ("a", "b", "c", "d"):
        log.append(served(f"chatcmpl-{name}"))
    log.append(served("chatcmpl-old", served_at=time.time() - 120))  # past the window, no feedback
    rate(log, "chatcmpl-c", 1.0)
    rate(log, "chatcmpl-a", 0.0)
    rate(log, "chatcmpl-c", 0.5)  # joins c's reward: c is not handed out yet

    first = log.matured()
    assert [t.stored.completion_id for t in first.turns] == ["chatcmpl-c", "chatcmpl-a"]
    assert [t.reward for t in first.turns] == [0.75, 0.0]
    assert (first.labeled, first.unlabeled, first.waiting) == (2, 1, 2)
    assert first.coverage == pytest.approx(2 / 3)

    rate(log, "chatcmpl-a", 1.0)  # a was handed out: it stays behind the cursor
    rate(log, "chatcmpl-b", 1.0)
    later = log.matured(after=first.cursor)
    assert [t.stored.completion_id for t in later.turns] == ["chatcmpl-b"]
    # a restarted log (turns from its files and segment) answers the same past the same cursor
    restarted = TrafficLog("run", str(tmp_path), TrafficConfig(flush_turns=2, mature_after_s=60))
    assert [t.stored.completion_id for t in restarted.matured(after=first.cursor).turns] == ["chatcmpl-b"]
    limited = restarted.matured(limit=1)
    assert [t.stored.completion_id for t in limited.turns] == ["chatcmpl-c"] and limited.more


# --- task keys and baselines ---------------------------------------------------------------------


def test_a_task_is_the_requests_metadata_task_else_its_system_prompt_and_tools() -> None:
    tool = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    assert task_key(served("x", task="refund").turn) == "task:refund"
    assert task_key(served("x").turn) == task_key(served("y").turn)  # another user message, same task
    assert task_key(served("x").turn) != task_key(served("x", tools=tool).turn)
    other = {"role": "system", "content": "You answer in two words."}
    assert task_key(served("x").turn) != task_key(served("x", system=other).turn)
    assert task_key(served("x").turn).startswith("prompt:")


def test_request_metadata_follows_openais_limits() -> None:
    assert request_metadata({"metadata": {"task": "refund"}}) == {"task": "refund"}
    assert request_metadata({}) is None
    for bad in ({"task": 3}, ["task"], {str(i): "v" for i in range(17)}, {"k" * 65: "v"}):
        with pytest.raises(ValueError, match="metadata"):
            request_metadata({"metadata": bad})


def test_a_tasks_running_mean_is_plain_then_exponential() -> None:
    mean = TaskMean()
    for reward in (1.0, 0.0, 0.5):
        mean.add(reward, window=4)
    assert mean.mean == pytest.approx(0.5)
    for _ in range(50):
        mean.add(1.0, window=4)
    assert mean.mean == pytest.approx(1.0, abs=1e-5)


def test_traffic_groups_compare_each_turn_with_its_tasks_mean(tmp_path: Path) -> None:
    log = TrafficLog("run", str(tmp_path), TrafficConfig())
    for name, task in (("a", "x"), ("b", "y"), ("c", "y")):
        log.append(served(f"chatcmpl-{name}", task=task))
    rate(log, "chatcmpl-a", 1.0)
    rate(log, "chatcmpl-b", 1.0)
    rate(log, "chatcmpl-c", 0.0)
    baselines = TaskBaselines()
    groups, report = traffic_groups(log.matured().turns, baselines)
    # x's lone first turn starts its mean; y's two turns compare with each other
    assert (report.groups, report.first_of_task, report.against_baseline) == (1, 1, 0)
    assert groups[0].baseline is None and groups[0].rewards == [1.0, 0.0]
    assert groups[0].trajectories[0].metadata["completion_id"] == "chatcmpl-b"
    assert baselines.baseline("task:x") == 1.0 and baselines.baseline("task:y") == 0.5

    log.append(served("chatcmpl-d", task="x"))
    rate(log, "chatcmpl-d", 0.0)
    groups, report = traffic_groups(
        log.matured(after=TrafficCursor(received_at=0, feedback_id="")).turns[-1:], baselines
    )
    assert report.against_baseline == 1 and groups[0].baseline == 1.0
    assert group_advantages(groups[0].rewards, scale=True, baseline=groups[0].baseline) == [-1.0]


def test_a_baseline_lets_one_trajectory_train_and_none_off_it_does_not() -> None:
    assert group_advantages([1.0], baseline=0.25) == [0.75]
    assert group_advantages([0.25, 0.25], baseline=0.25) is None
    assert group_advantages([1.0]) is None  # no baseline: a lone trajectory has no comparison
    assert TrajectoryGroup([], baseline=0.5).baseline == 0.5


# --- OnlineTrainer --------------------------------------------------------------------------------


class StandInModel:
    """What OnlineTrainer calls on a TrainableModel, over a real TrafficLog; train() records its groups
    (the real train call runs in test_sdk.py)."""

    def __init__(self, log: TrafficLog) -> None:
        self.log_, self.step, self.trained, self.fail_next = log, 0, [], False
        self.name, self.project, self.backend = "run", "tests", SimpleNamespace()
        self.config = SimpleNamespace(traffic=TrafficConfig(), release=None)

    async def get_step(self) -> int:
        return self.step

    async def matured_traffic(self, after, limit):  # noqa: ANN001, ANN201
        return self.log_.matured(after, limit)

    async def train(self, groups, config, verbose=True):  # noqa: ANN001, ANN201
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the trainer died")
        self.trained.append(groups)
        self.step += 1
        return self.step

    async def log(self, groups, split, metrics):  # noqa: ANN001, ANN201
        return metrics


def serve_and_rate(log: TrafficLog, names: list[str], version: int, rewards: list[float]) -> None:
    for name in names:
        log.append(served(f"chatcmpl-{name}", version=version, task="t"))
    for name, reward in zip(names, rewards, strict=True):
        rate(log, f"chatcmpl-{name}", reward)


def trained_ids(model: StandInModel) -> list[list[str]]:
    return [[t.metadata["completion_id"] for g in groups for t in g.trajectories] for groups in model.trained]


async def test_online_training_takes_each_labeled_turn_once_across_restarts_and_failures(
    tmp_path: Path,
) -> None:
    log = TrafficLog("run", str(tmp_path / "traffic"), TrafficConfig())
    model = StandInModel(log)
    config = OnlineTrainConfig(min_turns=2)
    trainer = OnlineTrainer(model, config, state_dir=str(tmp_path / "online"))  # type: ignore[arg-type]

    serve_and_rate(log, ["a"], 0, [1.0])
    assert await trainer.step() is None  # fewer than min_turns
    serve_and_rate(log, ["b"], 0, [0.0])
    report = await trainer.step()
    assert report is not None and report.trained and report.step == 1
    assert trained_ids(model) == [["chatcmpl-a", "chatcmpl-b"]]
    assert await trainer.step() is None  # nothing new

    # a restarted trainer picks up at the cursor of the model's step
    serve_and_rate(log, ["c", "d"], 1, [1.0, 0.0])
    restarted = OnlineTrainer(model, config, state_dir=str(tmp_path / "online"))  # type: ignore[arg-type]
    assert (await restarted.step()).step == 2  # type: ignore[union-attr]
    assert trained_ids(model)[-1] == ["chatcmpl-c", "chatcmpl-d"]  # against task t's mean of a and b
    assert model.trained[-1][0].baseline == 0.5

    # a step that fails leaves the file of a step the model never reached: its turns are taken again
    serve_and_rate(log, ["e", "f"], 2, [1.0, 0.0])
    model.fail_next = True
    with pytest.raises(RuntimeError):
        await restarted.step()
    again = OnlineTrainer(model, config, state_dir=str(tmp_path / "online"))  # type: ignore[arg-type]
    assert (await again.step()).step == 3  # type: ignore[union-attr]
    assert trained_ids(model)[-1] == ["chatcmpl-e", "chatcmpl-f"]
    assert sum(len(ids) for ids in trained_ids(model)) == 6  # each turn trained once


async def test_stale_turns_are_dropped_by_steps_and_by_age(tmp_path: Path) -> None:
    log = TrafficLog("run", str(tmp_path / "traffic"), TrafficConfig())
    model = StandInModel(log)
    model.step = 5
    config = OnlineTrainConfig(min_turns=1, max_steps_off_policy=2, max_age_s=600)
    trainer = OnlineTrainer(model, config, state_dir=str(tmp_path / "online"))  # type: ignore[arg-type]
    log.append(served("chatcmpl-old-version", version=2, task="t"))  # 3 steps behind
    log.append(served("chatcmpl-old-age", version=5, task="t", served_at=time.time() - 3600))
    for name in ("fresh-1", "fresh-2"):
        log.append(served(f"chatcmpl-{name}", version=4, task="t"))
    for name, reward in (("old-version", 1.0), ("old-age", 1.0), ("fresh-1", 1.0), ("fresh-2", 0.0)):
        rate(log, f"chatcmpl-{name}", reward)
    report = await trainer.step()
    assert report is not None and report.stale == 2 and report.steps_off_policy_max == 1
    assert trained_ids(model) == [["chatcmpl-fresh-1", "chatcmpl-fresh-2"]]
    assert report.metrics()["traffic/turns_stale"] == 2.0


async def test_a_batch_with_nothing_to_train_moves_the_cursor_without_a_step(tmp_path: Path) -> None:
    log = TrafficLog("run", str(tmp_path / "traffic"), TrafficConfig())
    model = StandInModel(log)
    trainer = OnlineTrainer(model, OnlineTrainConfig(min_turns=1), state_dir=str(tmp_path / "online"))  # type: ignore[arg-type]
    serve_and_rate(log, ["a"], 0, [1.0])  # a lone first turn of its task: it only starts the mean
    report = await trainer.step()
    assert report is not None and not report.trained and report.step == 0
    assert model.trained == [] and await trainer.step() is None
    resumed = OnlineTrainer(model, OnlineTrainConfig(min_turns=1), state_dir=str(tmp_path / "online"))  # type: ignore[arg-type]
    assert await resumed.step() is None  # the cursor was saved with step 0
