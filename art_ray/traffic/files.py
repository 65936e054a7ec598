"""A run's stored traffic on its storage root: Parquet files of turns and of feedback, and the
append-only segment that holds what came since the last file.

Folder `{storage}/{project}/models/{run}/traffic/`:

| file                               | one row per                                                  |
|------------------------------------|--------------------------------------------------------------|
| `turns-{first turn, ms}-{n}.parquet`    | turn: completion_id, model (`name@step`), policy_version,  |
|                                    | created_at, session_id, turn (CapturedTurn JSON)             |
| `feedback-{first, ms}-{n}.parquet` | feedback: feedback_id, completion_id, model, score, comment, |
|                                    | source, received_at                                          |

The segment (`segment.jsonl`, one JSON record per line: a turn or a feedback) is on the node's local disk:
in the traffic folder when the storage root is local, else in a spool folder of the node (a remote
store takes whole files only). Readable by pandas, DuckDB or Ray Data; imports no Ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pydantic

from art_ray.capture.turns import CapturedTurn
from art_ray.feedback import FeedbackRecord
from art_ray.storage import resolve_filesystem
from art_ray.traffic.records import StoredTurn, TrafficSnapshot

TURNS_PREFIX, FEEDBACK_PREFIX = "turns-", "feedback-"
SEGMENT_NAME = "segment.jsonl"

TURN_SCHEMA = pa.schema(
    [
        ("completion_id", pa.string()),
        ("model", pa.string()),
        ("policy_version", pa.int64()),
        ("created_at", pa.float64()),
        ("session_id", pa.string()),
        ("turn", pa.string()),
    ]
)
FEEDBACK_SCHEMA = pa.schema(
    [
        ("feedback_id", pa.string()),
        ("completion_id", pa.string()),
        ("model", pa.string()),
        ("score", pa.float64()),
        ("comment", pa.string()),
        ("source", pa.string()),
        ("received_at", pa.float64()),
    ]
)


class SegmentRecord(pydantic.BaseModel):
    """One line of the segment: a turn or a feedback."""

    turn: StoredTurn | None = None
    feedback: FeedbackRecord | None = None


def turns_table(turns: list[StoredTurn]) -> pa.Table:
    rows = [
        {
            "completion_id": stored.completion_id,
            "model": stored.turn.model,
            "policy_version": stored.turn.choice.get("policy_version"),
            "created_at": stored.turn.created_at,
            "session_id": stored.session_id,
            "turn": stored.turn.model_dump_json(),
        }
        for stored in turns
    ]
    return pa.Table.from_pylist(rows, schema=TURN_SCHEMA)


def feedback_table(records: list[FeedbackRecord]) -> pa.Table:
    return pa.Table.from_pylist([record.model_dump() for record in records], schema=FEEDBACK_SCHEMA)


def write_table(table: pa.Table, folder: str, name: str) -> None:
    """One whole file, written under a temporary name and renamed (a reader never sees half of it)."""
    filesystem, inner = resolve_filesystem(folder)
    filesystem.create_dir(inner, recursive=True)
    partial = f"{inner}/.{name}.partial"
    pq.write_table(table, partial, filesystem=filesystem)
    filesystem.move(partial, f"{inner}/{name}")


def file_names(folder: str, prefix: str) -> list[str]:
    """The folder's complete files of one kind, oldest first (their names start with their first ms)."""
    import pyarrow.fs as pafs

    filesystem, inner = resolve_filesystem(folder)
    infos = filesystem.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return sorted(
        info.base_name
        for info in infos
        if info.type == pafs.FileType.File
        and info.base_name.startswith(prefix)
        and info.base_name.endswith(".parquet")
    )


def _stored_turns(table: pa.Table) -> list[StoredTurn]:
    return [
        StoredTurn(turn=CapturedTurn.model_validate_json(row["turn"]), session_id=row["session_id"])
        for row in table.to_pylist()
    ]


def read_turns(folder: str, name: str) -> list[StoredTurn]:
    filesystem, inner = resolve_filesystem(folder)
    return _stored_turns(pq.read_table(f"{inner}/{name}", filesystem=filesystem))


def read_turns_with_ids(folder: str, completion_ids: set[str]) -> list[StoredTurn]:
    """The stored turns among `completion_ids`, from every turn file (only their rows are decoded)."""
    import pyarrow.compute as pc

    if not completion_ids:
        return []
    filesystem, inner = resolve_filesystem(folder)
    wanted = pc.field("completion_id").isin(sorted(completion_ids))
    found = []
    for name in file_names(folder, TURNS_PREFIX):
        found += _stored_turns(pq.read_table(f"{inner}/{name}", filesystem=filesystem, filters=wanted))
    return found


def read_feedback(folder: str, name: str) -> list[FeedbackRecord]:
    filesystem, inner = resolve_filesystem(folder)
    table = pq.read_table(f"{inner}/{name}", filesystem=filesystem)
    return [FeedbackRecord.model_validate(row) for row in table.to_pylist()]


def read_segment(path: Path) -> list[SegmentRecord]:
    """The segment's records; a last line cut short by a crash mid-write is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(SegmentRecord.model_validate(json.loads(line)))
        except (ValueError, pydantic.ValidationError):
            continue
    return records


def read_traffic(folder: str, segment: Path | None = None) -> TrafficSnapshot:
    """Everything stored in a run's traffic folder (and its segment, when given)."""
    turns = [turn for name in file_names(folder, TURNS_PREFIX) for turn in read_turns(folder, name)]
    feedback = [
        record for name in file_names(folder, FEEDBACK_PREFIX) for record in read_feedback(folder, name)
    ]
    for record in read_segment(segment) if segment is not None else []:
        if record.turn is not None:
            turns.append(record.turn)
        if record.feedback is not None:
            feedback.append(record.feedback)
    return TrafficSnapshot(turns=turns, feedback=feedback)
