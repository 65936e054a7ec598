"""The quickstart's code, run as written: docs/quickstart.md's Python block saved as first_agent.py and its
command run in a fresh folder, as a reader does after `make setup`. The script starts its own Ray cluster,
serves SmolLM2-135M-Instruct, trains two GRPO steps and shuts down; the test checks it printed both steps
and left the checkpoint, the Parquet files and the MLflow store where the page says.

It needs no session cluster, so it runs in the first block of the suite (tests/conftest.py), with the
machine to itself; most of its time is the cluster's, the engine's and the trainer's start. While it runs,
the sockets that the script's processes (Ray's, Serve's, the engines', the trainer's) listen on are listed
every half second: an embedded cluster is closed to the network (issue 49), all of them on loopback; and
vLLM's IPC sockets are in the engine process's own folder, not loose in the temp folder.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from art_ray.serving.ipc_dir import PREFIX as IPC_PREFIX

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"
RUN_MARKER = "<!-- run by tests/test_docs_quickstart.py -->"


def marked_blocks(page: Path, marker: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block right after a `marker` line, in page order."""
    pattern = re.escape(marker) + r"\n```(\w+)\n(.*?)\n```"
    return re.findall(pattern, page.read_text(), flags=re.S)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def listening_sockets(root: psutil.Process) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket and bound UDP socket in `root`'s tree."""
    found = set()
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            for connection in process.net_connections(kind="inet"):
                tcp_listening = connection.status == psutil.CONN_LISTEN
                udp_bound = connection.type == socket.SOCK_DGRAM and connection.laddr
                if tcp_listening or udp_bound:
                    found.add((connection.laddr.ip, connection.laddr.port, process.name()))
    return found


def unix_socket_paths(root: psutil.Process) -> set[str]:
    """The file path of every Unix socket in `root`'s tree (abstract and unnamed ones have none)."""
    found = set()
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            found |= {c.laddr for c in process.net_connections(kind="unix") if c.laddr.startswith("/")}
    return found


def run_listing_sockets(command: str, cwd: Path, timeout_s: float) -> tuple[int, str, set, set]:
    """Run `command`; its exit code, output, every socket its processes listened on meanwhile, and the
    paths of their Unix sockets."""
    log = cwd / "output.log"
    sockets: set[tuple[str, int, str]] = set()
    unix_paths: set[str] = set()
    with log.open("w") as out:
        process = subprocess.Popen(["bash", "-c", command], cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        root = psutil.Process(process.pid)
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout_s:.0f} s"
            sockets |= listening_sockets(root)
            unix_paths |= unix_socket_paths(root)
            time.sleep(0.5)
    return process.returncode, log.read_text(), sockets, unix_paths


def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    blocks = marked_blocks(PAGE, RUN_MARKER)
    assert [language for language, _ in blocks] == ["python", "bash"], blocks
    (_, script), (_, command) = blocks
    assert "first_agent.py" in command
    (tmp_path / "first_agent.py").write_text(script + "\n")
    # the command names the checkout's .venv; here it is the interpreter running the tests
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    code, output, sockets, unix_paths = run_listing_sockets(command, tmp_path, timeout_s=600)
    assert code == 0, output[-6000:]
    assert re.search(r"^step 1: mean reward [01]\.\d\d$", output, flags=re.M), output[-6000:]
    assert re.search(r"^step 2: mean reward [01]\.\d\d$", output, flags=re.M), output[-6000:]
    # Ray's GCS, raylet and workers, Serve's proxy, the replica's inter-deployment gRPC server (which Ray
    # Serve binds on "[::]:0" whatever the node's address; serving/replica_grpc.py binds it to the node's
    # loopback address), the trainer's process group: something listened, and all of it on loopback
    assert len(sockets) >= 5, sockets
    assert {listener for listener in sockets if not is_loopback(listener[0])} == set(), sockets
    # vLLM's IPC sockets in the engine's process's own folder (serving/ipc_dir.py), none loose in /tmp
    temp = Path(tempfile.gettempdir())
    assert {path for path in unix_paths if Path(path).parent == temp} == set(), unix_paths
    assert any(Path(path).parent.name.startswith(IPC_PREFIX) for path in unix_paths), unix_paths
    # where the page says: a complete step-2 checkpoint, the trained groups' Parquet, the MLflow store
    run = tmp_path / "art_ray_runs" / "quickstart" / "models" / "my-agent"
    assert (run / "checkpoints" / "0002" / "trainer_state.json").is_file(), sorted(run.rglob("*"))
    assert (run / "checkpoints" / "0002" / "adapter").is_dir()
    assert sorted(p.name for p in (run / "trajectories" / "train").glob("*.parquet")) == [
        "0000.parquet",
        "0001.parquet",
    ]
    assert (tmp_path / "art_ray_runs" / "mlflow.db").is_file()
