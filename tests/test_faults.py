"""The fault-injection run (bench/faults.py, short): a replica, a trainer rank, the registry and the driver
die in turn during a real run, and nothing is lost, logged twice or silently stale."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench" / "faults.py"


def test_a_run_survives_the_death_of_every_kind_of_actor(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--steps=5", f"--storage={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {
        **result,
        "faults": 4,
        "survived": 4,
        "steps_lost": 0,
        "trajectories_lost": 0,
        "silent_stale_steps": 0,
        "duplicated_metric_rows": 0,
        "run_status": "FINISHED",
    }, run.stdout[-3000:]
