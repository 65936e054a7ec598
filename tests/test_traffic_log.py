"""The traffic log's files and index without Ray (art_ray/traffic/log.py), the feedback body's checks and
the signed feedback tokens. The endpoint's side runs in test_sdk.py."""

from __future__ import annotations

import time
from pathlib import Path

import pydantic
import pytest

from art_ray.capture.turns import CapturedTurn
from art_ray.feedback import Feedback, TrafficConfig
from art_ray.serving.feedback_token import FeedbackSigner
from art_ray.traffic.files import SEGMENT_NAME, file_names, read_traffic
from art_ray.traffic.log import TrafficLog
from art_ray.traffic.records import StoredTurn


def stored(completion_id: str, served_at: float | None = None, session_id: str | None = None) -> StoredTurn:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
        "token_ids": [5, 6],
        "policy_version": 2,
        "sampling_params": {"temperature": 0.7},
    }
    turn = CapturedTurn(
        request_messages=[{"role": "user", "content": "hello"}],
        choice=choice,
        model="run@2",
        created_at=served_at or time.time(),
        completion_id=completion_id,
    )
    return StoredTurn(turn=turn, session_id=session_id)


def score(completion_id: str | None = None, value: float = 1.0, **fields: object) -> Feedback:
    return Feedback(completion_id=completion_id, score=value, **fields)


def new_log(folder: Path, **config: float) -> TrafficLog:
    return TrafficLog("run", str(folder), TrafficConfig(**config))


def test_turns_and_feedback_go_to_parquet_and_come_back_after_a_restart(tmp_path: Path) -> None:
    log = new_log(tmp_path, flush_turns=3)
    for index in range(4):
        log.append(stored(f"chatcmpl-{index}"))
    assert log.add_feedback(score("chatcmpl-1", 0.5, comment="ok"), "chatcmpl-1").status == 200
    # three records made the first file; the fourth turn and the feedback wait in the segment
    assert len(file_names(str(tmp_path), "turns-")) == 1
    assert len((tmp_path / SEGMENT_NAME).read_text().splitlines()) == 2

    restarted = new_log(tmp_path, flush_turns=3)  # what Ray does when the actor dies
    snapshot = restarted.snapshot()
    assert [turn.completion_id for turn in snapshot.turns] == [f"chatcmpl-{i}" for i in range(4)]
    assert snapshot.turns[0].turn.choice["sampling_params"] == {"temperature": 0.7}
    assert [(f.completion_id, f.score, f.comment) for f in snapshot.feedback] == [("chatcmpl-1", 0.5, "ok")]
    # the restarted log knows the old turns: feedback on one is stored
    assert restarted.add_feedback(score("chatcmpl-3", 0.0), "chatcmpl-3").status == 200
    assert (tmp_path / SEGMENT_NAME).read_text().count("\n") == 1


def test_a_segment_that_repeats_a_file_is_not_stored_twice(tmp_path: Path) -> None:
    log = new_log(tmp_path)
    log.append(stored("chatcmpl-a"))
    segment = (tmp_path / SEGMENT_NAME).read_text()
    log.flush()
    (tmp_path / SEGMENT_NAME).write_text(segment + '{"turn": {"trunc')  # a crash before the truncation
    snapshot = new_log(tmp_path).snapshot()
    assert [turn.completion_id for turn in snapshot.turns] == ["chatcmpl-a"]


def test_feedback_is_idempotent_by_its_id_and_names_a_stored_turn(tmp_path: Path) -> None:
    log = new_log(tmp_path)
    log.append(stored("chatcmpl-a", session_id="s" * 16))
    log.append(stored("chatcmpl-b", session_id="s" * 16))
    first = log.add_feedback(score("chatcmpl-a", feedback_id="f" * 16), "chatcmpl-a")
    again = log.add_feedback(score("chatcmpl-a", 0.0, feedback_id="f" * 16), "chatcmpl-a")
    assert again.record == first.record and again.record.score == 1.0
    by_session = log.add_feedback(Feedback(session_id="s" * 16, score=0.25), None)
    assert by_session.record.completion_id == "chatcmpl-b"  # the session's latest turn
    unknown = log.add_feedback(score("chatcmpl-zzz"), "chatcmpl-zzz")
    assert unknown.status == 404 and unknown.record is None and "chatcmpl-zzz" in unknown.message
    assert len(log.snapshot().feedback) == 2


def test_turns_past_retention_are_deleted_and_their_feedback_refused(tmp_path: Path) -> None:
    log = new_log(tmp_path, retention_s=60)
    log.append(stored("chatcmpl-old", served_at=time.time() - 120))
    log.append(stored("chatcmpl-new"))
    assert log.add_feedback(score("chatcmpl-old"), "chatcmpl-old").status == 404
    assert log.add_feedback(score("chatcmpl-new"), "chatcmpl-new").status == 200
    log.flush()
    # a file is deleted once everything in it is past retention (its name says when it was written)
    name = file_names(str(tmp_path), "turns-")[0]
    aged = name.rsplit("-", 1)[0] + f"-{int((time.time() - 120) * 1000):013d}.parquet"
    (tmp_path / name).rename(tmp_path / aged)
    new_log(tmp_path, retention_s=60)
    assert read_traffic(str(tmp_path)).turns == []


def test_feedback_bodies_are_checked() -> None:
    with pytest.raises(pydantic.ValidationError, match="finite"):
        Feedback(completion_id="chatcmpl-a", score=float("nan"))
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        Feedback(completion_id="chatcmpl-a", session_id="s" * 16, score=1)
    with pytest.raises(pydantic.ValidationError):
        Feedback(completion_id="chatcmpl-a", score=1, source="crowd")
    with pytest.raises(pydantic.ValidationError):
        Feedback(completion_id="chatcmpl-a", score=1, feedback_id="short")
    assert Feedback(token="x.y", score=1).completion_id is None  # a token names the turn itself


def test_feedback_tokens_are_signed_per_completion_and_deployment() -> None:
    signer = FeedbackSigner("admin-key")
    token = signer.sign("run", "chatcmpl-1")
    assert signer.verify(token) == ("run", "chatcmpl-1")
    payload, mac = token.split(".")
    assert signer.verify(f"{payload}.{'0' * len(mac)}") is None
    assert FeedbackSigner("another-key").verify(token) is None
    forged = FeedbackSigner("admin-key").sign("run", "chatcmpl-2").split(".")[0]
    assert signer.verify(f"{forged}.{mac}") is None
    assert signer.verify("garbage") is None


def test_signed_feedback_for_a_turn_not_stored_yet_waits_for_it_across_a_restart(tmp_path: Path) -> None:
    log = new_log(tmp_path, early_feedback_s=60)
    early = log.add_feedback(score("chatcmpl-s", 1.0, feedback_id="e" * 16), "chatcmpl-s", signed=True)
    assert early.status == 202 and early.record is not None
    again = log.add_feedback(score("chatcmpl-s", 0.0, feedback_id="e" * 16), "chatcmpl-s", signed=True)
    assert again.status == 202 and again.record == early.record
    unsigned = log.add_feedback(score("chatcmpl-s", 1.0), "chatcmpl-s")  # a key, not a token: no proof
    assert unsigned.status == 404
    assert log.matured().turns == []  # nothing to train until the turn is stored

    restarted = new_log(tmp_path, early_feedback_s=60)  # the stream's turn comes after a restart
    restarted.append(stored("chatcmpl-s"))
    matured = restarted.matured()
    assert [(t.stored.completion_id, t.reward) for t in matured.turns] == [("chatcmpl-s", 1.0)]
    assert [f.feedback_id for f in restarted.snapshot().feedback] == ["e" * 16]

    late = new_log(tmp_path / "late", early_feedback_s=0.01)
    late.add_feedback(score("chatcmpl-t"), "chatcmpl-t", signed=True)
    time.sleep(0.05)
    late.matured()  # forgets what waited too long: the stream never finished
    late.append(stored("chatcmpl-t"))
    assert late.matured().turns == []
