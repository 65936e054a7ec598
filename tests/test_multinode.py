"""Two Ray nodes on one machine: the trainer on one, the inference replica on the other, each with its own
temp folder. After `train`, the replica serves the new step: the adapter travelled through Ray's object
store, not through a shared path; a capture session's turn, recorded by that replica, is read from the
driver's node. Runs tests/multinode_driver.py in its own process (its own Ray)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.slow


def test_the_adapter_reaches_a_replica_on_another_node() -> None:
    driver = Path(__file__).with_name("multinode_driver.py")
    # a short root: the engine's IPC sockets live in the node's TMPDIR (socket paths max 107 bytes)
    root = tempfile.mkdtemp(prefix="art-mn-", dir="/tmp")
    try:
        completed = subprocess.run(
            [sys.executable, str(driver), root, str(free_port())], capture_output=True, text=True, timeout=600
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert completed.returncode == 0, completed.stderr[-6000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])

    nodes = result["nodes"]
    assert nodes["trainer_node"] != nodes["inference_node"]
    assert result["trainer_node"] == nodes["trainer_node"]
    assert result["replica_node"] == nodes["inference_node"]
    assert result["step"] == 1 and {"mn", "mn@0", "mn@1"} <= set(result["served"])
    assert result["after"] != result["before"] and result["still_step_0"] == result["before"]
    # the replica recorded the capture session's turn in the cluster's store, read from the driver's node
    assert result["capture_store_node"] in nodes.values()
    assert result["captured_ids"] == [result["sampled_ids"]] and result["sampled_ids"]
    # the trainer wrote checkpoints in its storage; the replica wrote the adapter it loads in its own
    # node's temp folder; nothing was written for the replica on the trainer's node
    assert "0001" in result["checkpoints"]
    assert any("/mn/000001-" in path for path in result["replica_adapters"]), result["replica_adapters"]
    assert result["trainer_tmp_adapters"] == []
