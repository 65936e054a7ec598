"""The default backend: a fork-server per slot inside its own user, pid, mount, network, IPC and UTS
namespaces, as its own unprivileged uid (zygote.py has the inside). Needs Linux with user namespaces and
nothing else: no root, no container runtime, no setuid helper.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import sys
from pathlib import Path

from art_ray.errors import SandboxError, SandboxFileError
from art_ray.sandbox.types import ExecResult, SandboxLimits

# a folder of the slot's root holding `python` and `python3`: the interpreter's names
INTERPRETER_NAMES = "/.interpreter"

ZYGOTE = Path(__file__).with_name("zygote.py")
# slack past a command's own timeout before the caller calls the slot broken (the slot enforces the timeout)
REPLY_GRACE_S = 5.0
START_TIMEOUT_S = 30.0
KILL_GRACE_S = 1.0


def default_read_only_paths() -> list[str]:
    """/usr and the interpreter (its prefix and the virtual environment): what a command and the Python
    code need; nothing of the host's home, /etc, /var or /tmp."""
    return sorted({"/usr", sys.base_prefix, sys.prefix})


class NamespaceBackend:
    """Slots as uid `first_uid + index` (root starts them; a normal user's slots all share its own uid,
    and so their process budget). Two pools at once must use different `first_uid`s."""

    name = "namespaces"

    def __init__(self, first_uid: int = 100000, read_only_paths: list[str] | None = None) -> None:
        self.first_uid = first_uid
        self.read_only_paths = read_only_paths or default_read_only_paths()

    async def start_slot(self, index: int, limits: SandboxLimits) -> NamespaceSlot:
        root = os.geteuid() == 0
        config = {
            "parent_pid": os.getpid(),
            "uid": self.first_uid + index if root else os.geteuid(),
            "drop_groups": root,
            "read_only_paths": self.read_only_paths,
            # last: `python` and `python3` name this interpreter where its folder has no such names (a
            # system interpreter is /usr/bin/python3.11 alone on Debian)
            "path": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin:{INTERPRETER_NAMES}",
            "interpreter": sys.executable,
            "interpreter_names": INTERPRETER_NAMES,
            # the zygote starts with -S (site's .pth files, art_ray's editable finder among them, cost ~45 ms
            # of a ~100 ms start): the model's Python gets the site-packages folders without their .pth hooks
            "site_packages": [path for path in sys.path if path.endswith("site-packages")],
            "limits": limits.model_dump(),
        }
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                str(ZYGOTE),
                json.dumps(config),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={},
                close_fds=True,
            )
        except OSError as error:
            raise SandboxError(f"slot {index} could not start: {error}") from error
        slot = NamespaceSlot(index, limits, process)
        try:
            hello = await asyncio.wait_for(slot.receive(), START_TIMEOUT_S)
        except (SandboxError, TimeoutError) as error:
            slot.kill()
            diagnostics = (await process.stderr.read(8192)).decode(errors="replace")
            raise SandboxError(f"slot {index} did not start: {error}\n{diagnostics}") from error
        slot.seccomp = hello["seccomp"]
        return slot


class NamespaceSlot:
    def __init__(self, index: int, limits: SandboxLimits, process: asyncio.subprocess.Process) -> None:
        self.index, self.limits, self.process = index, limits, process
        self.seccomp = False
        self.broken = False
        # one request at a time on the pipes; the pool leases a slot to one user, whose calls may overlap
        self.lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return not self.broken and self.process.returncode is None

    async def receive(self) -> dict:
        try:
            (size,) = struct.unpack(">I", await self.process.stdout.readexactly(4))
            return json.loads(await self.process.stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as error:
            self.broken = True
            raise SandboxError(f"slot {self.index} stopped answering: {error!r}") from error

    async def request(self, message: dict, timeout_s: float) -> dict:
        async with self.lock:
            if not self.alive:
                raise SandboxError(f"slot {self.index} is dead")
            data = json.dumps(message).encode()
            try:
                self.process.stdin.write(struct.pack(">I", len(data)) + data)
                await self.process.stdin.drain()
                return await asyncio.wait_for(self.receive(), timeout_s + REPLY_GRACE_S)
            except (ConnectionError, TimeoutError) as error:
                self.kill()
                raise SandboxError(f"slot {self.index} failed a request: {error!r}") from error
            except BaseException:  # cancelled mid-request: the reply would land in the next one's place
                self.kill()
                raise

    async def execute(self, message: dict, timeout_s: float) -> ExecResult:
        return ExecResult.model_validate(await self.request({**message, "timeout_s": timeout_s}, timeout_s))

    async def run(self, command: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        return await self.execute(
            {"op": "exec", "argv": ["/bin/bash", "-c", command], "stdin": stdin}, timeout_s
        )

    async def python(self, code: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        return await self.execute({"op": "python", "python": code, "stdin": stdin}, timeout_s)

    async def file_request(self, message: dict) -> dict:
        reply = await self.request(message, self.limits.wall_s)
        if "error" in reply:
            raise SandboxFileError(f"{message['op']} {message['path']!r}: {reply['error']}")
        return reply

    async def write_file(self, path: str, data: bytes) -> None:
        await self.file_request({"op": "write_file", "path": path, "data": base64.b64encode(data).decode()})

    async def read_file(self, path: str) -> bytes:
        return base64.b64decode((await self.file_request({"op": "read_file", "path": path}))["data"])

    async def list_dir(self, path: str) -> list[str]:
        return (await self.file_request({"op": "list_dir", "path": path}))["entries"]

    async def reset(self) -> None:
        reply = await self.request({"op": "reset"}, self.limits.wall_s)
        if reply["leftover"]:
            self.kill()
            raise SandboxError(f"slot {self.index} kept {reply['leftover']} processes after a reset")

    async def process_count(self) -> int:
        """Processes of the slot besides its init (a leak check)."""
        return (await self.request({"op": "processes"}, self.limits.wall_s))["count"]

    def kill(self) -> None:
        """End every process of the slot, from any state. Closing the request pipe makes the init exit (its
        pid namespace goes with it) and its parent reap it; SIGKILL follows in case the init is wedged. A
        SIGKILL first would leave the init a zombie of the host's pid 1, which reaps at its own pace (~2 s
        on this box)."""
        self.broken = True
        self.process.stdin.close()
        if self.process.returncode is None:
            asyncio.get_running_loop().call_later(KILL_GRACE_S, self.kill_now)

    def kill_now(self) -> None:
        if self.process.returncode is None:
            self.process.kill()  # the init dies of PR_SET_PDEATHSIG, and its pid namespace with it

    async def close(self) -> None:
        self.kill()
        try:
            await asyncio.wait_for(self.process.wait(), KILL_GRACE_S + 1)
        except TimeoutError:
            self.kill_now()
            await self.process.wait()
