"""The traffic log: one Ray actor per run that stores its served turns and the feedback on them.

The endpoint's replicas append each turn of a run that opted in (`ModelConfig.traffic`) before the
client gets the response's last byte; feedback arrives through `/v1/feedback`. Both go first to an
append-only segment on the node's disk, then, every `flush_turns` turns or `flush_s` seconds, into
Parquet files on the run's storage (art_ray/traffic/files.py). Memory holds an index (completion id ->
when it was served, feedback ids), never the turns: feedback may come days later. A log that restarts
(Ray restarts it) reads its files and its segment back, so no stored turn or feedback is lost; a record
already in a file is not stored twice. Turns and feedback older than the retention are deleted, and
feedback for such a turn is answered as for an unknown one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pydantic
import ray

from art_ray.cluster_actors import LONG_LIVED_OPTIONS, NAMESPACE
from art_ray.feedback import Feedback, FeedbackRecord, TrafficConfig, new_feedback_id
from art_ray.releases import ArmStats
from art_ray.storage import resolve_filesystem
from art_ray.traffic.files import (
    FEEDBACK_PREFIX,
    SEGMENT_NAME,
    TURNS_PREFIX,
    SegmentRecord,
    feedback_table,
    file_names,
    read_feedback,
    read_segment,
    read_traffic,
    read_turns_with_ids,
    turns_table,
    write_table,
)
from art_ray.traffic.records import LabeledTurn, MaturedTraffic, StoredTurn, TrafficCursor, TrafficSnapshot


class FeedbackOutcome(pydantic.BaseModel):
    """The log's answer to a feedback: the record stored (or the one already stored under its id; 202:
    it waits for its turn), or why none was (404: no such turn of this run, or one past retention)."""

    record: FeedbackRecord | None = None
    status: int = 200
    message: str = ""


def traffic_log_name(run: str) -> str:
    return f"art_ray_traffic:{run}"


def spool_folder(run: str, folder: str) -> Path:
    """Where the run's segment lives: its traffic folder when that is local, else a folder of this node."""
    if "://" not in folder:
        return Path(resolve_filesystem(folder)[1])
    return Path("~/.cache/art-ray/traffic").expanduser() / run


class TrafficLog:
    """The log's state and files; `TrafficLogActor` runs it as the run's actor."""

    def __init__(self, run: str, folder: str, config: TrafficConfig) -> None:
        self._run, self._folder, self._config = run, folder, config
        spool = spool_folder(run, folder)
        spool.mkdir(parents=True, exist_ok=True)
        self._segment_path = spool / SEGMENT_NAME
        self._served: dict[str, float] = {}  # completion id -> served at
        self._version_of: dict[str, int] = {}  # completion id -> the step that sampled it
        self._arms: dict[int, ArmStats] = {}  # per step: guardrails of its turns, first scores (releases)
        self._labeled: set[str] = set()  # completion ids with feedback
        self._last_of_session: dict[str, str] = {}  # capture session -> its latest completion id
        self._feedback: dict[str, FeedbackRecord] = {}
        self._turns: list[StoredTurn] = []  # since the last file (they are also in the segment)
        self._new_feedback: list[FeedbackRecord] = []
        # signed feedback for a turn not stored yet (a stream still being sent), by feedback id
        self._early: dict[str, FeedbackRecord] = {}
        self._first_unflushed: float | None = None
        self._load()

    def _load(self) -> None:
        filesystem, inner = resolve_filesystem(self._folder)
        for name in file_names(self._folder, TURNS_PREFIX):
            for row in pq.read_table(f"{inner}/{name}", filesystem=filesystem).to_pylist():
                choice = json.loads(row["turn"])["choice"]
                self._index(row["completion_id"], row["created_at"], row["session_id"], choice)
        for name in file_names(self._folder, FEEDBACK_PREFIX):
            for record in sorted(read_feedback(self._folder, name), key=lambda r: r.received_at):
                self._count_score(record)
                self._feedback[record.feedback_id] = record
        # the segment may repeat what a file already holds (a crash between the file and the truncation);
        # its turns first: an early feedback precedes its turn there
        segment = read_segment(self._segment_path)
        for record in segment:
            if record.turn is not None and record.turn.completion_id not in self._served:
                self._keep_turn(record.turn)
        for record in segment:
            if record.feedback is None or record.feedback.feedback_id in self._feedback:
                continue
            if record.feedback.completion_id in self._served:
                self._keep_feedback(record.feedback)
            else:
                self._early[record.feedback.feedback_id] = record.feedback
        self._rewrite_segment()
        self._expire()

    # --- the endpoint's calls -------------------------------------------------------------------

    def append(self, stored: StoredTurn) -> None:
        """Store a served turn (returns once it is in the segment)."""
        if stored.completion_id in self._served:
            return
        self._write([SegmentRecord(turn=stored)])
        self._keep_turn(stored)
        for early in [r for r in self._early.values() if r.completion_id == stored.completion_id]:
            del self._early[early.feedback_id]
            self._keep_feedback(early)
        self._maybe_flush()

    def add_feedback(
        self, feedback: Feedback, completion_id: str | None, signed: bool = False
    ) -> FeedbackOutcome:
        """Store a feedback for one of the run's turns (`completion_id`, or the latest turn of
        `feedback.session_id` when None); the same `feedback_id` again answers the first record.
        `signed`: the completion id comes from this deployment's feedback token, so it was served: if its
        turn is not stored yet (a stream still being sent), the feedback waits for it (202) up to
        `TrafficConfig.early_feedback_s`."""
        if feedback.feedback_id is not None and feedback.feedback_id in self._feedback:
            return FeedbackOutcome(record=self._feedback[feedback.feedback_id])
        if feedback.feedback_id is not None and feedback.feedback_id in self._early:
            return FeedbackOutcome(record=self._early[feedback.feedback_id], status=202)
        self._forget_expired()  # the files are pruned when they are written, not per feedback
        if completion_id is None and feedback.session_id is not None:
            completion_id = self._last_of_session.get(feedback.session_id)
        early = signed and completion_id is not None and completion_id not in self._served
        if not early and (completion_id is None or completion_id not in self._served):
            target = completion_id or f"capture session {feedback.session_id!r}"
            message = (
                f"no stored turn {target!r} of model {self._run!r}: unknown, not stored (the run does not "
                f"capture traffic, or the request said store: false), or past retention "
                f"({self._config.retention_s:.0f} s)"
            )
            return FeedbackOutcome(status=404, message=message)
        record = FeedbackRecord(
            feedback_id=feedback.feedback_id or new_feedback_id(),
            completion_id=completion_id,
            model=self._run,
            score=feedback.score,
            comment=feedback.comment,
            source=feedback.source,
            received_at=time.time(),
        )
        self._write([SegmentRecord(feedback=record)])
        if early:
            self._early[record.feedback_id] = record
            return FeedbackOutcome(record=record, status=202)
        self._keep_feedback(record)
        self._maybe_flush()
        return FeedbackOutcome(record=record)

    # --- the SDK's ------------------------------------------------------------------------------

    def snapshot(self) -> TrafficSnapshot:
        """Every stored turn and feedback (written to Parquet first)."""
        self.flush()
        return read_traffic(self._folder)

    def matured(self, after: TrafficCursor | None = None, limit: int = 256) -> MaturedTraffic:
        """The labeled turns whose first feedback came after `after`, in that order, up to `limit`, each
        with all its feedback so far; and the counts of labeled, unlabeled and waiting turns retained."""
        self._forget_expired()
        feedback_of: dict[str, list[FeedbackRecord]] = {}
        for record in self._feedback.values():
            feedback_of.setdefault(record.completion_id, []).append(record)
        for records in feedback_of.values():
            records.sort(key=lambda record: (record.received_at, record.feedback_id))
        window_closed = time.time() - self._config.mature_after_s
        unlabeled = sum(cid not in feedback_of and at < window_closed for cid, at in self._served.items())
        first = {
            cid: (records[0].received_at, records[0].feedback_id) for cid, records in feedback_of.items()
        }
        order = sorted(
            (cid for cid in first if after is None or first[cid] > after.key()), key=first.__getitem__
        )
        chosen = order[:limit]
        wanted = set(chosen)
        unflushed = {turn.completion_id: turn for turn in self._turns if turn.completion_id in wanted}
        stored = {
            turn.completion_id: turn for turn in read_turns_with_ids(self._folder, wanted - set(unflushed))
        }
        stored.update(unflushed)
        return MaturedTraffic(
            turns=[
                LabeledTurn(stored=stored[cid], feedback=feedback_of[cid]) for cid in chosen if cid in stored
            ],
            more=len(order) > limit,
            labeled=len(feedback_of),
            unlabeled=unlabeled,
            waiting=len(self._served) - len(feedback_of) - unlabeled,
        )

    def arm_stats(self) -> dict[int, ArmStats]:
        """Per served step, the guardrails of its stored turns and the first score of each labeled one:
        what a release compares (art_ray/releases.py)."""
        return self._arms

    def folder(self) -> str:
        return self._folder

    def flush(self) -> None:
        """Write what came since the last file into Parquet files, then empty the segment."""
        suffix = f"{int(time.time() * 1000):013d}"
        if self._turns:
            first = int(self._turns[0].turn.created_at * 1000)
            write_table(
                turns_table(self._turns), self._folder, f"{TURNS_PREFIX}{first:013d}-{suffix}.parquet"
            )
        if self._new_feedback:
            first = int(self._new_feedback[0].received_at * 1000)
            name = f"{FEEDBACK_PREFIX}{first:013d}-{suffix}.parquet"
            write_table(feedback_table(self._new_feedback), self._folder, name)
        self._turns, self._new_feedback, self._first_unflushed = [], [], None
        self._rewrite_segment()
        self._expire()

    # --- inside ---------------------------------------------------------------------------------

    def _index(self, completion_id: str, created_at: float, session_id: str | None, choice: dict) -> None:
        self._served[completion_id] = created_at
        if session_id is not None:
            self._last_of_session[session_id] = completion_id
        version = choice.get("policy_version")
        if isinstance(version, int):
            self._version_of[completion_id] = version
            self._arms.setdefault(version, ArmStats()).add_turn(choice)

    def _count_score(self, record: FeedbackRecord) -> None:
        """A turn's first feedback joins its step's scores (one value per turn: they are independent)."""
        if record.completion_id in self._labeled:
            return
        self._labeled.add(record.completion_id)
        version = self._version_of.get(record.completion_id)
        if version is not None:
            self._arms.setdefault(version, ArmStats()).score.add(record.score)

    def _keep_turn(self, stored: StoredTurn) -> None:
        self._index(stored.completion_id, stored.turn.created_at, stored.session_id, stored.turn.choice)
        self._turns.append(stored)
        self._first_unflushed = self._first_unflushed or time.monotonic()

    def _keep_feedback(self, record: FeedbackRecord) -> None:
        self._count_score(record)
        self._feedback[record.feedback_id] = record
        self._new_feedback.append(record)
        self._first_unflushed = self._first_unflushed or time.monotonic()

    def _write(self, records: list[SegmentRecord]) -> None:
        with self._segment_path.open("a") as segment:
            segment.write("".join(record.model_dump_json() + "\n" for record in records))

    def _rewrite_segment(self) -> None:
        """The segment holds exactly what no file holds yet."""
        records = [SegmentRecord(turn=turn) for turn in self._turns]
        records += [SegmentRecord(feedback=record) for record in [*self._new_feedback, *self._early.values()]]
        partial = self._segment_path.with_suffix(".partial")
        partial.write_text("".join(record.model_dump_json() + "\n" for record in records))
        partial.replace(self._segment_path)

    def _maybe_flush(self) -> None:
        pending = len(self._turns) + len(self._new_feedback)
        waited = time.monotonic() - (self._first_unflushed or time.monotonic())
        if pending >= self._config.flush_turns or (pending and waited >= self._config.flush_s):
            self.flush()

    def _expire(self) -> None:
        """Forget turns past retention and delete the files that hold only such turns (or feedback)."""
        cutoff = self._forget_expired()
        filesystem, inner = resolve_filesystem(self._folder)
        for name in file_names(self._folder, TURNS_PREFIX) + file_names(self._folder, FEEDBACK_PREFIX):
            newest = int(name.rsplit("-", 1)[1].removesuffix(".parquet")) / 1000  # written at
            if newest < cutoff:
                filesystem.delete_file(f"{inner}/{name}")

    def _forget_expired(self) -> float:
        """Drop the index's turns past retention (and their sessions' and feedback's entries); the cutoff."""
        cutoff = time.time() - self._config.retention_s
        for completion_id in [cid for cid, at in self._served.items() if at < cutoff]:
            del self._served[completion_id]
            self._version_of.pop(completion_id, None)
            self._labeled.discard(completion_id)
        for session_id in [s for s, cid in self._last_of_session.items() if cid not in self._served]:
            del self._last_of_session[session_id]
        for feedback_id in [f for f, r in self._feedback.items() if r.completion_id not in self._served]:
            del self._feedback[feedback_id]
        waited_since = time.time() - self._config.early_feedback_s
        for feedback_id in [f for f, r in self._early.items() if r.received_at < waited_since]:
            del self._early[feedback_id]  # its stream never finished
        return cutoff


TrafficLogActor = ray.remote(num_cpus=0)(TrafficLog)


def ensure_traffic_log(run: str, folder: str, config: TrafficConfig) -> ray.actor.ActorHandle:
    """The run's traffic log, started unless it runs (restarted by Ray if it dies)."""
    # a call made while it restarts waits for it: every call is safe to repeat (a turn is stored once by
    # its completion id, a feedback by its id, which the endpoint draws before the call)
    return TrafficLogActor.options(
        name=traffic_log_name(run),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        **LONG_LIVED_OPTIONS,
    ).remote(run, folder, config)


def get_traffic_log(run: str) -> ray.actor.ActorHandle:
    """The run's traffic log; ValueError if none runs."""
    return ray.get_actor(traffic_log_name(run), namespace=NAMESPACE)
