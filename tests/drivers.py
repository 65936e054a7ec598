"""Trainer drivers (tests/*_driver.py) run in processes of their own: DeepSpeed's process group is global
to a process, and each driver builds its engines on DeepSpeed's CPU accelerator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_driver(name: str) -> dict:
    """Runs tests/`name`; returns the JSON object its last line prints."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(name))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
