"""A backend over bubblewrap (`bwrap`), for hosts that have it: one `bwrap` per command, run as the slot's
own uid (bwrap run by root with `--unshare-user` would map the sandbox to host root), with
`--unshare-all --die-with-parent --new-session`, a read-only system, a fresh /proc and /dev, a tmpfs /tmp,
the slot's workspace folder bound at /workspace, and util-linux `prlimit` for the rlimits.

Differences from the namespace backend: a command's background processes end with it (each command has its
own pid namespace), Python starts cold for each call, the workspace is a host folder (`tempfile`), and the
interpreter must lie where the slot uid may read it (not under a 0700 /root). Not exercised on the box this
was written on (no `bwrap` there); tests/test_sandbox.py runs its battery over it where `bwrap` exists.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time

from art_ray.errors import SandboxError, SandboxFileError
from art_ray.sandbox.namespaces import default_read_only_paths
from art_ray.sandbox.types import ExecResult, SandboxLimits

CHUNK = 65536


class BubblewrapBackend:
    name = "bubblewrap"

    def __init__(self, first_uid: int = 100000, read_only_paths: list[str] | None = None) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed on this host")
        self.first_uid = first_uid
        self.read_only_paths = read_only_paths or default_read_only_paths()

    async def start_slot(self, index: int, limits: SandboxLimits) -> BubblewrapSlot:
        uid = self.first_uid + index if os.geteuid() == 0 else os.geteuid()
        workspace = tempfile.mkdtemp(prefix=f"artray-bwrap-{index}-")
        os.chown(workspace, uid, uid)
        return BubblewrapSlot(index, limits, uid, workspace, self.bwrap, self.read_only_paths)


async def read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, int]:
    kept, total = bytearray(), 0
    while data := await stream.read(CHUNK):
        total += len(data)
        kept += data[: max(0, cap - len(kept))]
    return bytes(kept), total


class BubblewrapSlot:
    def __init__(
        self, index: int, limits: SandboxLimits, uid: int, workspace: str, bwrap: str, read_only: list[str]
    ) -> None:
        self.index, self.limits, self.uid, self.workspace = index, limits, uid, workspace
        self.bwrap, self.read_only = bwrap, read_only
        self.running: asyncio.subprocess.Process | None = None
        self.closed = False

    @property
    def alive(self) -> bool:
        return not self.closed

    def command(self, argv: list[str]) -> list[str]:
        mb, limits = 1024 * 1024, self.limits
        binds = [arg for path in self.read_only if os.path.exists(path) for arg in ("--ro-bind", path, path)]
        links = [
            arg
            for name in ("bin", "sbin", "lib", "lib64")
            if os.path.islink(f"/{name}")
            for arg in ("--symlink", os.readlink(f"/{name}"), f"/{name}")
        ]
        prlimit = [
            "prlimit",
            f"--cpu={limits.cpu_s}",
            f"--data={limits.memory_mb * mb}",
            f"--fsize={limits.file_size_mb * mb}",
            f"--nofile={limits.open_files}",
            f"--nproc={limits.processes + 2}",
            "--core=0",
            "--",
        ]
        return [
            self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            *binds, *links, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", self.workspace, "/workspace", "--chdir", "/workspace", "--hostname", "sandbox",
            "--clearenv", "--setenv", "PATH", f"{sys.prefix}/bin:/usr/bin:/bin",
            "--setenv", "HOME", "/workspace",
            "--", *prlimit, *argv,
        ]  # fmt: skip

    async def execute(self, argv: list[str], timeout_s: float, stdin: str | None) -> ExecResult:
        started = time.monotonic()
        try:
            self.running = process = await asyncio.create_subprocess_exec(
                *self.command(argv),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                user=self.uid,
                group=self.uid,
                extra_groups=[],
                env={},
                close_fds=True,
                start_new_session=True,
            )
        except OSError as error:
            raise SandboxError(f"bwrap did not start: {error}") from error
        process.stdin.write((stdin or "").encode())
        process.stdin.close()
        cap = self.limits.output_bytes
        outputs = asyncio.gather(
            read_capped(process.stdout, cap), read_capped(process.stderr, cap), process.wait()
        )
        timed_out = False
        try:
            (out, out_total), (err, err_total), code = await asyncio.wait_for(
                asyncio.shield(outputs), timeout_s
            )
        except TimeoutError:
            timed_out = True
            os.killpg(process.pid, 9)  # bwrap's pid namespace dies with it (--die-with-parent)
            (out, out_total), (err, err_total), code = await outputs
        finally:
            self.running = None
        return ExecResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            exit_code=None if timed_out else code,
            timed_out=timed_out or code in (-9, -24),
            truncated=out_total > cap or err_total > cap,
            duration_s=time.monotonic() - started,
        )

    async def run(self, command: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        return await self.execute(["/bin/bash", "-c", command], timeout_s, stdin)

    async def python(self, code: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        return await self.execute([f"{sys.prefix}/bin/python", "-I", "-c", code], timeout_s, stdin)

    def host_path(self, path: str) -> str:
        """The workspace file for a sandbox path; symlinks resolved, and refused when they lead out."""
        relative = os.path.relpath(path, "/workspace") if os.path.isabs(path) else path
        resolved = os.path.realpath(os.path.join(self.workspace, relative))
        if not resolved.startswith(self.workspace + os.sep) and resolved != self.workspace:
            raise SandboxFileError(f"{path!r} is outside /workspace")
        return resolved

    async def write_file(self, path: str, data: bytes) -> None:
        target = self.host_path(path)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(data)
            os.chown(target, self.uid, self.uid)
        except OSError as error:
            raise SandboxFileError(f"write_file {path!r}: {error}") from error

    async def read_file(self, path: str) -> bytes:
        try:
            with open(self.host_path(path), "rb") as handle:
                return handle.read(self.limits.file_size_mb * 1024 * 1024)
        except OSError as error:
            raise SandboxFileError(f"read_file {path!r}: {error}") from error

    async def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.host_path(path)))
        except OSError as error:
            raise SandboxFileError(f"list_dir {path!r}: {error}") from error

    async def reset(self) -> None:
        self.kill()
        for entry in os.scandir(self.workspace):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)

    def kill(self) -> None:
        if self.running is not None and self.running.returncode is None:
            os.killpg(self.running.pid, 9)

    async def close(self) -> None:
        self.kill()
        self.closed = True
        shutil.rmtree(self.workspace, ignore_errors=True)
