"""Sandboxes for agents that run code: a pool of warm, isolated slots leased one rollout at a time.

    from art_ray.sandbox import SandboxLimits, SandboxPool

    async with SandboxPool(slots=8, limits=SandboxLimits(wall_s=5)) as pool:
        async with pool.lease(ttl_s=600) as box:
            await box.write_file("a.py", "print(6 * 7)")
            result = await box.run("python a.py")

No torch or ray here: the pool runs in any asyncio process. Backends: `NamespaceBackend` (default; Linux
user namespaces, nothing else needed) and `BubblewrapBackend` (where `bwrap` is installed).
"""

from art_ray.errors import LeaseExpired, SandboxBusy, SandboxError, SandboxFileError
from art_ray.sandbox.backend import SandboxBackend, SandboxSlot
from art_ray.sandbox.grading import TestOutcome, run_tests
from art_ray.sandbox.pool import Sandbox, SandboxPool
from art_ray.sandbox.shared import SharedSandboxes
from art_ray.sandbox.tools import SANDBOX_TOOLS, SandboxTools
from art_ray.sandbox.types import ExecResult, LeasedSandbox, SandboxLimits

__all__ = [
    "SANDBOX_TOOLS",
    "ExecResult",
    "LeaseExpired",
    "LeasedSandbox",
    "Sandbox",
    "SandboxBackend",
    "SandboxBusy",
    "SandboxError",
    "SandboxFileError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxSlot",
    "SandboxTools",
    "SharedSandboxes",
    "TestOutcome",
    "run_tests",
]
