"""The subprocess sandbox examples/code_math used before it moved onto art_ray.sandbox's pool (issue 48),
kept as bench/sandbox.py's baseline only: its four holes (a finished program reported timed out, host /tmp
written, 300 MB of output held in the caller, preexec_fn in threaded processes) are tests/test_sandbox.py's
regression tests. Run untrusted Python in a child process with limits.

Enforced: a fresh temporary working folder (deleted after), an empty environment, isolated mode
(`python -I -S`: no user site, no site-packages), a wall-clock timeout and a CPU-time limit, an
address-space limit, a cap on file sizes and open files, no child processes, captured output cut to a
maximum, and no network: the child runs in a new network namespace (`unshare -rn`, only a down loopback)
when the kernel allows it; otherwise an audit hook refuses socket creation inside the child.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

import pydantic

# Inside the child, before the user's code: refuse sockets (a fallback for hosts without namespaces).
GUARD = """
import sys
def _guard(event, args):
    if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"):
        raise PermissionError("network access is disabled in the sandbox")
sys.addaudithook(_guard)
del _guard
"""


class SandboxResult(pydantic.BaseModel):
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool


@functools.cache
def network_namespace_available() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    return subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0


def _limits(memory_mb: int, cpu_seconds: int) -> None:
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, 1024 * 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    if os.getuid() != 0:  # root ignores RLIMIT_NPROC; the child then may fork, still inside the limits
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    os.setsid()


RUN_MAIN = "exec(compile(open('main.py').read(), 'main.py', 'exec'))"


def run_python(
    code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 4096
) -> SandboxResult:
    """Run `code` as main.py in a fresh folder under the limits above; never raises for the code's sake."""
    command = [sys.executable, "-I", "-S", "-c", GUARD + RUN_MAIN]
    if network_namespace_available():
        command = ["unshare", "-rn", *command]
    with tempfile.TemporaryDirectory(prefix="art-sandbox-") as folder:
        with open(os.path.join(folder, "main.py"), "w") as handle:
            handle.write(code)
        try:
            completed = subprocess.run(
                command,
                cwd=folder,
                env={"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder},
                capture_output=True,
                timeout=timeout_s,
                # the CPU limit is a backstop past the wall-clock timeout
                preexec_fn=functools.partial(_limits, memory_mb, math.ceil(timeout_s) + 1),
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as expired:
            return SandboxResult(
                stdout=(expired.stdout or b"")[:max_output].decode(errors="replace"),
                stderr=(expired.stderr or b"")[:max_output].decode(errors="replace"),
                exit_code=None,
                timed_out=True,
            )
    # killed by the CPU-time limit (SIGXCPU at the soft limit, SIGKILL at the hard one): out of time too
    cpu_killed = completed.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    return SandboxResult(
        stdout=completed.stdout[:max_output].decode(errors="replace"),
        stderr=completed.stderr[:max_output].decode(errors="replace"),
        exit_code=None if cpu_killed else completed.returncode,
        timed_out=cpu_killed,
    )
