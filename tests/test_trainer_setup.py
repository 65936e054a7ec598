"""A trainer rank's setup never waits on a lock file left by a killed process."""

from __future__ import annotations

import os
import subprocess
import sys

from torch.utils.file_baton import FileBaton

STARTS_WITHOUT_SHM_OP = """
from art_ray.trainer.engine import skip_shared_memory_allreduce
from deepspeed.comm.torch import build_shm_op
skip_shared_memory_allreduce()
assert build_shm_op() is None
print("no shm op")
"""


def test_cpu_rank_setup_ignores_a_stale_torch_extensions_lock(tmp_path) -> None:
    # what a rank killed while loading DeepSpeed's shm all-reduce op leaves behind
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert not FileBaton(str(lock)).try_acquire()  # torch's extension loader would wait on it forever
    completed = subprocess.run(
        [sys.executable, "-c", STARTS_WITHOUT_SHM_OP],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "no shm op" in completed.stdout
    assert lock.exists()
