"""Where the model's program runs: art-ray's sandbox pool (art_ray.sandbox), one lease per program, never
the rollout's own process, the driver's or the trainer's.

On Ray (rollouts run in rollout runners), every runner leases from one named host actor of the job,
started by the first program: warm slots, each its own uid, pid, mount and network namespaces, a
private workspace reset between leases, the limits below. Without Ray (a driver that trains through
HTTPBackend runs its rollouts in place), a pool in this process.

A failure of the sandbox itself raises SandboxError: the rollout fails and its sample is dropped from the
group, never scored 0 (the model did nothing wrong).
"""

from __future__ import annotations

import asyncio
import threading

import ray

from art_ray.sandbox import ExecResult, SandboxLimits, SandboxPool
from art_ray.sandbox.host import RaySandboxPool
from art_ray.sandbox.namespaces import NamespaceBackend

# what the earlier subprocess sandbox enforced: 5 s, 256 MB, output cut at 4 KiB, no network
LIMITS = SandboxLimits(wall_s=5, cpu_s=6, memory_mb=256, processes=16, output_bytes=4096)
SLOTS = 4
HOST_NAME = "code-math-sandboxes"
# slots' uids: apart from the default pool's (100000) and the tests' (170000-172999)
FIRST_UID = 120000
# slots of a pool in this process (no Ray, or TRL's reward functions): apart from the host's
LOCAL_FIRST_UID = 121000
# a lease holds one program; its time to live only reaps a rollout that died holding it
LEASE_TTL_S = 60.0

_ray_pools: dict[str, RaySandboxPool] = {}  # by Ray job: a new session's host is another actor
_local_pools: dict[asyncio.AbstractEventLoop, asyncio.Task[SandboxPool]] = {}
_blocking_loop: asyncio.AbstractEventLoop | None = None
_blocking_lock = threading.Lock()


async def run_program(code: str) -> ExecResult:
    """`code` as main.py in a fresh workspace under LIMITS; its outcome (the code's failures included)."""
    if not ray.is_initialized():
        return await _run_local(code)
    job = ray.get_runtime_context().get_job_id()
    if job not in _ray_pools:
        _ray_pools[job] = await RaySandboxPool.start(
            SLOTS, LIMITS, resources={}, first_uid=FIRST_UID, name=HOST_NAME
        )
    async with _ray_pools[job].lease(ttl_s=LEASE_TTL_S) as box:
        return await box.python(code)


def run_program_blocking(code: str) -> ExecResult:
    """run_program for synchronous callers (TRL's reward functions), on a pool of a private event loop in
    this process (TRL's process is no rollout runner)."""
    global _blocking_loop
    with _blocking_lock:
        if _blocking_loop is None:
            _blocking_loop = asyncio.new_event_loop()
            threading.Thread(target=_blocking_loop.run_forever, daemon=True, name="code-math-sandbox").start()
    return asyncio.run_coroutine_threadsafe(_run_local(code), _blocking_loop).result()


async def _run_local(code: str) -> ExecResult:
    loop = asyncio.get_running_loop()
    if loop not in _local_pools:
        _local_pools[loop] = loop.create_task(
            _started(SandboxPool(SLOTS, LIMITS, NamespaceBackend(LOCAL_FIRST_UID)))
        )
    pool = await _local_pools[loop]
    async with pool.lease(ttl_s=LEASE_TTL_S) as box:
        return await box.python(code)


async def _started(pool: SandboxPool) -> SandboxPool:
    await pool.start()
    return pool
