"""A process that owns every core gets one OpenMP thread pinned to each, and counts its threads right
(its main thread's own mask is a single core once pinned); a role with a fixed thread count is left
unpinned. Checked in real child processes with torch's own OpenMP runtime."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from art_ray.cpu_threads import EVERY_CORE_PINNED, engine_openmp_env, trainer_openmp_env

PROBE = """
import json, os, torch
from art_ray.cpu_threads import every_core_threads
threads = every_core_threads()
torch.set_num_threads(threads)
a = torch.randn(256, 256)
for _ in range(20):
    a @ a
masks = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{os.getpid()}/task")]
print(json.dumps({"threads": threads, "masks": masks}))
"""


def probe(env: dict[str, str], cores: list[int]) -> dict:
    child_env = {key: value for key, value in os.environ.items() if not key.startswith("OMP_")}
    out = subprocess.run(
        ["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c", PROBE],
        env={**child_env, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_role_settings() -> None:
    assert trainer_openmp_env(None) == EVERY_CORE_PINNED
    assert trainer_openmp_env(3) == {"OMP_NUM_THREADS": "3"}
    assert engine_openmp_env(1, None) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert engine_openmp_env(2, "0-1")["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell pinned threads apart")
def test_every_core_process_pins_one_thread_per_core() -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = probe(trainer_openmp_env(None), cores)
    assert result["threads"] == 2
    pinned = sorted(mask[0] for mask in result["masks"] if len(mask) == 1)
    # the main thread on the first core, the team's other thread on the second
    assert set(pinned) == set(cores), result
    # one core of the same process's mask: one thread
    assert probe(trainer_openmp_env(None), cores[1:])["threads"] == 1
