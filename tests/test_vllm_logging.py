"""vLLM's lines in an engine process a replica started by spawn (art_ray/serving/vllm_logging.py): the
process is handed the replica's logging config (no dictConfig) and gets its handler from the plugin."""

from __future__ import annotations

import os
import subprocess
import sys

from art_ray.serving.vllm_logging import LINES_OF_A_REPLICA

SPAWNED_ENGINE_PROCESS = f"""
import logging, os
from importlib.metadata import entry_points

# the entry point vLLM's load_general_plugins() calls in each engine process
plugin = entry_points(group="vllm.general_plugins")["art_ray_vllm_lines"].load()
plugin()  # a process no replica started: vLLM's logging is left as it is
assert not logging.getLogger("vllm").handlers
os.environ[{LINES_OF_A_REPLICA!r}] = "1"  # as a spawned engine core inherits it from its replica
plugin()
logging.getLogger("vllm.lora.worker_manager").info("Loaded new LoRA adapter: name 'm@1'")
"""


def test_a_spawned_engine_process_of_a_replica_writes_vllms_lines_to_stdout() -> None:
    env = {key: value for key, value in os.environ.items() if key != LINES_OF_A_REPLICA}
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # vLLM's default (importing TRL sets ERROR in the test process)
    done = subprocess.run(
        [sys.executable, "-c", SPAWNED_ENGINE_PROCESS], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "INFO" in done.stdout and "Loaded new LoRA adapter: name 'm@1'" in done.stdout
