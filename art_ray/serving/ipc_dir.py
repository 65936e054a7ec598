"""vLLM's ZeroMQ IPC sockets in a folder that the process starting the engine owns.

vLLM names each of an engine's IPC sockets `{VLLM_RPC_BASE_PATH}/{uuid4}`, by default in the temp folder,
and removes them only on a clean shutdown. Replicas and engine processes that are killed (Serve replacing
a replica, `ray stop`, a fault) left their socket files behind: ~2,200 in /tmp here after a day of tests
and soaks. Each process that starts an engine points VLLM_RPC_BASE_PATH at `art-ray-vllm-ipc-<pid>` in the
temp folder, removed when the process exits normally; a later start on the same host removes the folders
of processes that are gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "art-ray-vllm-ipc-"


def own_ipc_dir(root: str | None = None) -> Path:
    """Point vLLM's IPC sockets at this process's folder (created), after removing the folders of processes
    that no longer run; the folder."""
    base = Path(root or tempfile.gettempdir())
    for folder in base.glob(f"{PREFIX}*"):
        pid = folder.name.removeprefix(PREFIX)
        if pid.isdigit() and int(pid) != os.getpid() and not running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    folder = base / f"{PREFIX}{os.getpid()}"
    if not folder.is_dir():
        folder.mkdir(mode=0o700)
        atexit.register(shutil.rmtree, folder, True)
    os.environ["VLLM_RPC_BASE_PATH"] = str(folder)
    return folder


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True
