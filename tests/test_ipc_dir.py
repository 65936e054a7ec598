"""vLLM's IPC sockets go in a folder of the process that starts the engine, and a start removes the folders
of processes that are gone (art_ray/serving/ipc_dir.py). tests/test_docs_quickstart.py checks where a
running deployment's sockets are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from art_ray.serving.ipc_dir import PREFIX, own_ipc_dir


def test_a_start_owns_a_folder_and_removes_only_those_of_processes_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/unset")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone_pid = int(gone.stdout)
    for name in (f"{PREFIX}{gone_pid}", f"{PREFIX}{os.getppid()}", f"{PREFIX}notapid", "someone-else"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "0f1be554-68c0-47fb-9e8e-e778b55ec911").touch()

    folder = own_ipc_dir(str(tmp_path))

    assert folder == tmp_path / f"{PREFIX}{os.getpid()}" and folder.is_dir()
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{PREFIX}{os.getpid()}", f"{PREFIX}{os.getppid()}", f"{PREFIX}notapid", "someone-else"]
    )
    assert own_ipc_dir(str(tmp_path)) == folder  # a second engine in the same process shares it
