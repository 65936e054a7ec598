"""The interface every sandbox backend implements: it starts slots, and a slot runs commands and Python,
reads and writes files, resets and closes. The pool (pool.py) leases slots; it never knows the backend."""

from __future__ import annotations

from typing import Protocol

from art_ray.sandbox.types import ExecResult, SandboxLimits


class SandboxSlot(Protocol):
    """One warm sandbox. Calls on one slot do not overlap (the pool leases a slot to one user at a time).
    The model's code never makes a call raise; the machinery's failures raise SandboxError, and file
    operations the model got wrong raise SandboxFileError."""

    index: int

    @property
    def alive(self) -> bool: ...

    async def run(self, command: str, timeout_s: float, stdin: str | None = None) -> ExecResult: ...

    async def python(self, code: str, timeout_s: float, stdin: str | None = None) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def list_dir(self, path: str) -> list[str]: ...

    async def reset(self) -> None:
        """Kill every process of the slot and empty its workspace; raise SandboxError if that failed."""

    def kill(self) -> None:
        """Kill every process of the slot now, from any state (a lease's time to live, a broken pipe)."""

    async def close(self) -> None: ...


class SandboxBackend(Protocol):
    name: str

    async def start_slot(self, index: int, limits: SandboxLimits) -> SandboxSlot: ...
