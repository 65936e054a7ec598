"""Trajectory groups <-> one Parquet file.

Schema, one row per trajectory (readable by pandas, Ray Data, DuckDB):

| column               | type                 | meaning                                              |
|----------------------|----------------------|------------------------------------------------------|
| group_index          | int32                | index of the group in the written list               |
| trajectory_index     | int32                | index of the trajectory in its group                 |
| reward               | float64              |                                                      |
| metrics              | map<string, float64> | ints and bools are stored as floats                  |
| metadata             | string (JSON object) |                                                      |
| logs                 | list<string>         |                                                      |
| messages_and_choices | string (JSON array)  | messages as dicts; served choices as OpenAI `Choice` |
|                      |                      | objects (with token ids, logprobs, policy_version    |
|                      |                      | and sampling_params: what each was sampled with)     |
| tools                | string (JSON) / null |                                                      |
| additional_histories | string (JSON array)  | [{messages_and_choices, tools}, ...]                 |
| initial_policy_version | int64 / null       | the trained step that served its first turn        |
| final_policy_version | int64 / null         | ... and its last turn                                |

Group-level data (metadata, exceptions, metrics, logs; also groups with no trajectory) is kept in the
file's schema metadata under `art_ray.groups` as a JSON array indexed by group_index.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from art_ray.storage import resolve_filesystem
from art_ray.trajectories import Trajectory, TrajectoryGroup

SCHEMA_VERSION = "1"
GROUPS_KEY = b"art_ray.groups"
VERSION_KEY = b"art_ray.schema_version"

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("group_index", pa.int32()),
        ("trajectory_index", pa.int32()),
        ("reward", pa.float64()),
        ("metrics", pa.map_(pa.string(), pa.float64())),
        ("metadata", pa.string()),
        ("logs", pa.list_(pa.string())),
        ("messages_and_choices", pa.string()),
        ("tools", pa.string()),
        ("additional_histories", pa.string()),
        ("initial_policy_version", pa.int64()),
        ("final_policy_version", pa.int64()),
    ]
)


def _row(group_index: int, trajectory_index: int, trajectory: Trajectory) -> dict:
    dumped = trajectory.model_dump(mode="json")
    return {
        "group_index": group_index,
        "trajectory_index": trajectory_index,
        "reward": trajectory.reward,
        "metrics": [(name, float(value)) for name, value in trajectory.metrics.items()],
        "metadata": json.dumps(dumped["metadata"]),
        "logs": list(trajectory.logs),
        "messages_and_choices": json.dumps(dumped["messages_and_choices"]),
        "tools": None if trajectory.tools is None else json.dumps(dumped["tools"]),
        "additional_histories": json.dumps(dumped["additional_histories"]),
        "initial_policy_version": trajectory.initial_policy_version,
        "final_policy_version": trajectory.final_policy_version,
    }


def groups_to_table(groups: list[TrajectoryGroup]) -> pa.Table:
    rows = [
        _row(group_index, trajectory_index, trajectory)
        for group_index, group in enumerate(groups)
        for trajectory_index, trajectory in enumerate(group.trajectories)
    ]
    group_info = [
        {
            "metadata": group.metadata,
            "exceptions": [e.model_dump() for e in group.exceptions],
            "metrics": group.metrics,
            "logs": group.logs,
            "baseline": group.baseline,
        }
        for group in groups
    ]
    schema = TRAJECTORY_SCHEMA.with_metadata(
        {GROUPS_KEY: json.dumps(group_info).encode(), VERSION_KEY: SCHEMA_VERSION.encode()}
    )
    return pa.Table.from_pylist(rows, schema=schema)


def table_to_groups(table: pa.Table) -> list[TrajectoryGroup]:
    schema_metadata = table.schema.metadata or {}
    if GROUPS_KEY in schema_metadata:
        group_info = json.loads(schema_metadata[GROUPS_KEY])
    else:  # written by another tool: rebuild the groups from the rows alone
        count = max(table.column("group_index").to_pylist(), default=-1) + 1
        group_info = [{"metadata": {}, "exceptions": []} for _ in range(count)]
    trajectories: list[list[tuple[int, Trajectory]]] = [[] for _ in group_info]
    for row in table.to_pylist():
        trajectory = Trajectory(
            messages_and_choices=json.loads(row["messages_and_choices"]),
            tools=None if row["tools"] is None else json.loads(row["tools"]),
            additional_histories=json.loads(row["additional_histories"] or "[]"),
            reward=row["reward"],
            metrics=dict(row["metrics"] or []),
            metadata=json.loads(row["metadata"] or "{}"),
            logs=list(row["logs"] or []),
            # files written before these columns existed have none
            initial_policy_version=row.get("initial_policy_version"),
            final_policy_version=row.get("final_policy_version"),
        )
        trajectories[row["group_index"]].append((row["trajectory_index"], trajectory))
    return [
        TrajectoryGroup(
            [trajectory for _, trajectory in sorted(members, key=lambda pair: pair[0])],
            metadata=info["metadata"],
            exceptions=info["exceptions"],
            metrics=info.get("metrics", {}),
            logs=info.get("logs", []),
            baseline=info.get("baseline"),
        )
        for info, members in zip(group_info, trajectories, strict=True)
    ]


def write_trajectory_groups(groups: list[TrajectoryGroup], path: str | Path) -> None:
    """Write groups to one Parquet file at a local path or pyarrow.fs URI (parent folders are created).
    The file is written beside and moved into place, so a crash mid-write leaves the old file whole."""
    filesystem, inner = resolve_filesystem(path)
    parent = inner.rsplit("/", 1)[0]
    if parent:
        filesystem.create_dir(parent, recursive=True)
    partial = f"{inner}.partial"
    pq.write_table(groups_to_table(groups), partial, filesystem=filesystem)
    filesystem.move(partial, inner)


def read_trajectory_groups(path: str | Path) -> list[TrajectoryGroup]:
    """The groups of one Parquet file written by `write_trajectory_groups` (or by the backend for each
    step), from a local path or a pyarrow.fs URI; served choices come back as `Choice` objects."""
    filesystem, inner = resolve_filesystem(path)
    return table_to_groups(pq.read_table(inner, filesystem=filesystem))
