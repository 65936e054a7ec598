"""The sandbox pool on Ray (art_ray/sandbox/host.py), on the session's cluster: a host actor serves leases
call by call, its errors reach the caller as themselves, a lease nobody releases is reaped at its time to
live, and a host asking for `{"sandbox": 1}` waits for a node that has it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from art_ray.errors import SandboxError, SandboxFileError
from art_ray.sandbox import SandboxLimits, SandboxTools

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the per-slot uids need root")

FIRST_UID = 171000  # apart from tests/test_sandbox.py's and the default's
LIMITS = SandboxLimits(wall_s=3, memory_mb=256, processes=16, output_bytes=4096, workspace_mb=16)


def live_processes_of_slots() -> int:
    from test_sandbox import sandbox_processes

    return len(sandbox_processes(FIRST_UID))


async def test_a_host_serves_leases_in_order_and_reaps_an_abandoned_one(ray_cluster) -> None:
    from art_ray.sandbox.host import RaySandboxPool

    # resources={}: the session's cluster has no sandbox nodes, so the host goes where Ray puts it
    pool = await RaySandboxPool.start(slots=2, limits=LIMITS, resources={}, first_uid=FIRST_UID)
    try:
        async with pool.lease(ttl_s=30) as box:
            await box.write_file("a.txt", "hello")
            assert await box.read_file("a.txt") == b"hello"
            assert (await box.run("cat a.txt")).stdout == "hello"
            assert (await box.python("print(6 * 7)")).stdout == "42\n"
            # the agent tools take a box on Ray as they take a local one
            assert (
                await SandboxTools(box).call("bash", {"command": "cat a.txt"})
                == "exit code 0\nstdout:\nhello"
            )
            with pytest.raises(SandboxFileError):
                await box.read_file("missing")

        async def rollout(index: int) -> str:
            async with pool.lease(ttl_s=30) as box:
                return (await box.python(f"print({index})")).stdout

        assert await asyncio.gather(*(rollout(i) for i in range(16))) == [f"{i}\n" for i in range(16)]

        abandoned = await pool.host.acquire.remote(0.5)  # a driver that died holding its lease
        await pool.host.run.remote(abandoned, "setsid sleep 1000 > /dev/null 2>&1 < /dev/null &", None, None)
        await asyncio.sleep(1.5)
        assert (await pool.host.stats.remote())["leased"] == 0
        with pytest.raises(SandboxError):
            await pool.host.run.remote(abandoned, "echo late", None, None)
        async with pool.lease(ttl_s=30) as box:  # its slot is back, reset
            assert (await box.run("echo back")).stdout == "back\n"
    finally:
        await pool.close()
    deadline = time.monotonic() + 3
    while live_processes_of_slots() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_processes_of_slots() == 0


def test_a_host_asking_for_sandbox_nodes_waits_for_one(ray_cluster) -> None:
    import ray

    from art_ray.sandbox.host import SandboxHost

    placed = ray.remote(SandboxHost).options(num_cpus=0, resources={"sandbox": 1})
    host = placed.remote(1, LIMITS.model_dump())
    ready, _ = ray.wait([host.start.remote()], timeout=2)
    assert ready == []  # no node of the session's cluster offers {"sandbox": 1}
    ray.kill(host)


@pytest.mark.slow
def test_shared_sandboxes_go_to_the_sandbox_nodes_of_a_cluster_that_has_them(tmp_path: Path) -> None:
    """On a simulated cluster with two CPU nodes offering {"sandbox": 1} and a head that does not, the
    job's router puts a host on each sandbox node and spreads overlapping leases over both
    (tests/sandbox_nodes_driver.py, in its own process)."""
    driver = Path(__file__).with_name("sandbox_nodes_driver.py")
    completed = subprocess.run(
        [sys.executable, str(driver)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    placed = json.loads(completed.stdout.strip().splitlines()[-1])
    assert placed["outputs"] == [str(index) for index in range(12)]
    assert placed["nodes_used"] == placed["sandbox_nodes"]  # both sandbox nodes, never the head
    assert placed["stats"]["leased"] == 0 and sorted(placed["stats"]["hosts"]) == placed["sandbox_nodes"]
