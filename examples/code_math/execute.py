"""Where the model's program runs: art-ray's sandbox pool (art_ray.sandbox), one lease per program, never
the rollout's own process, the driver's or the trainer's. On Ray every rollout runner leases from one
named host actor of the job, started by the first program; without Ray, a pool in this process
(art_ray.sandbox.SharedSandboxes). Each slot: its own uid, pid, mount and network namespaces, a private
workspace reset between leases, the limits below.

A failure of the sandbox itself raises SandboxError: the rollout fails and its sample is dropped from the
group, never scored 0 (the model did nothing wrong).
"""

from __future__ import annotations

from art_ray.sandbox import ExecResult, SandboxLimits, SharedSandboxes

SANDBOXES = SharedSandboxes(
    name="code-math-sandboxes",
    slots=4,
    # what the earlier subprocess sandbox enforced: 5 s, 256 MB, output cut at 4 KiB, no network
    limits=SandboxLimits(wall_s=5, cpu_s=6, memory_mb=256, processes=16, output_bytes=4096),
    first_uid=120000,  # apart from the default pool's (100000) and the tests' (170000-172999)
)
# a lease holds one program; its time to live only reaps a rollout that died holding it
LEASE_TTL_S = 60.0


async def run_program(code: str) -> ExecResult:
    """`code` as main.py in a fresh workspace under the limits; its outcome (the code's failures included)."""
    async with SANDBOXES.lease(LEASE_TTL_S) as box:
        return await box.python(code)


def run_program_blocking(code: str) -> ExecResult:
    """For synchronous callers (TRL's reward functions): on this process's own pool, Ray or not."""

    async def run() -> ExecResult:
        async with SANDBOXES.lease_here(LEASE_TTL_S) as box:
            return await box.python(code)

    return SANDBOXES.run_blocking(run())
