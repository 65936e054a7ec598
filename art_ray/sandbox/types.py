"""What crosses the sandbox's boundary: its limits and a command's result (pydantic, no heavy imports)."""

from __future__ import annotations

from typing import Protocol

import pydantic


class SandboxLimits(pydantic.BaseModel):
    """Limits of one sandbox. Without a delegated cgroup they are rlimits: memory, CPU time and file size
    bind each process, `processes` binds the slot as a whole (one uid per slot)."""

    cpu_s: int = pydantic.Field(10, gt=0, description="CPU seconds per process (RLIMIT_CPU)")
    memory_mb: int = pydantic.Field(512, gt=0, description="data segment per process (RLIMIT_DATA)")
    processes: int = pydantic.Field(32, gt=0, description="processes of the slot at once (RLIMIT_NPROC)")
    file_size_mb: int = pydantic.Field(16, gt=0, description="largest file written (RLIMIT_FSIZE)")
    workspace_mb: int = pydantic.Field(64, gt=0, description="size of /workspace, and of /tmp (tmpfs)")
    open_files: int = pydantic.Field(256, gt=0, description="open file descriptors per process")
    wall_s: float = pydantic.Field(30.0, gt=0, description="a command's wall-clock limit unless it says")
    output_bytes: int = pydantic.Field(65536, gt=0, description="bytes kept of stdout, and of stderr")
    network: bool = pydantic.Field(
        False, description="True is refused for now: a sandbox has only a loopback of its own"
    )

    @pydantic.field_validator("network")
    @classmethod
    def _no_network_yet(cls, network: bool) -> bool:
        if network:
            raise ValueError("network access is not offered yet: sandboxes have only their own loopback")
        return network


class ExecResult(pydantic.BaseModel):
    """One command's outcome. The model's code decides exit_code and timed_out; nothing here is an error
    of the sandbox (those raise SandboxError)."""

    stdout: str
    stderr: str
    exit_code: int | None = pydantic.Field(description="negative: killed by that signal; None: timed out")
    timed_out: bool = pydantic.Field(description="past the wall-clock or the CPU-time limit")
    truncated: bool = pydantic.Field(description="stdout or stderr was longer than output_bytes")
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class LeasedSandbox(Protocol):
    """What a lease hands out, whether the pool is in this process (`Sandbox`) or on Ray
    (`RemoteSandbox`): the calls tools and graders make."""

    async def run(
        self, command: str, timeout_s: float | None = None, stdin: str | None = None
    ) -> ExecResult: ...

    async def python(
        self, code: str, timeout_s: float | None = None, stdin: str | None = None
    ) -> ExecResult: ...

    async def write_file(self, path: str, data: str | bytes) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def list_dir(self, path: str = ".") -> list[str]: ...
