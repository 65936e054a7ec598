"""Hand-over of shared devices between engine replicas and a trainer that take turns (colocated layout).

The two sides call the same methods on every device; only what the calls free differs:
- GPU: the engine sleeps at vLLM level 1 (KV cache dropped, weights to host) while the trainer trains,
  and wakes with its prefix cache reset; the trainer moves its frozen base weights and optimizer states
  to host while the engine samples.
- CPU (the twin): the engine pauses its scheduler (vLLM's level 0: nothing to free, requests that
  arrive meanwhile wait instead of taking cores from the trainer); the trainer's tensors already live on
  the host, and it hands back the heap its step freed (glibc keeps freed memory for reuse: a demo step
  left 0.3 GiB of freed activations resident in the rank until the next step). The waiting side is blocked
  (paused scheduler, a trainer between Ray calls), and OpenMP's default wait policy spins only briefly
  after a parallel region before its threads sleep, so the running side gets every core.
  OMP_WAIT_POLICY=PASSIVE was measured and dropped: it made each of the trainer's many small parallel
  regions wake sleeping threads (a step 24% slower, 1.64 cores of 2).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from art_ray.placement import Device

if TYPE_CHECKING:
    import torch


def release_freed_host_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim; a no-op elsewhere). The process's
    own symbols hold the C library's, so no lookup of it (find_library runs ldconfig, then a compiler)."""
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


class EngineHandover:
    """A replica's side: `release()` before the trainer trains, `reclaim()` before sampling again."""

    def __init__(self, engine: Any, device: Device) -> None:
        self._engine = engine  # vllm.v1.engine.async_llm.AsyncLLM
        self.level = 1 if device == "gpu" else 0
        self.released = False

    async def release(self) -> None:
        # "wait": requests already running finish first (a straggler is not aborted mid-answer)
        await self._engine.sleep(level=self.level, mode="wait")
        self.released = True

    async def reclaim(self) -> None:
        if not self.released:
            return
        if self.level == 0:
            await self._engine.wake_up(tags=["scheduling"])
        else:
            await self._engine.wake_up(tags=None)
            # KV blocks computed before the sleep are gone; stale prefix entries must not be reused
            await self._engine.reset_prefix_cache()
        self.released = False


class TrainerHandover:
    """A trainer rank's side: `offload()` after its step, `reload()` before the next one."""

    def __init__(self, module: torch.nn.Module, optimizer_engine: Any, device: Device) -> None:
        self._module = module
        self._engine = optimizer_engine  # a DeepSpeed engine
        self._device = device
        self._home: torch.device | None = None

    def _frozen(self) -> list[torch.Tensor]:
        # The frozen base weights are nearly all of a LoRA trainer's memory; the adapter's own parameters
        # stay where DeepSpeed's optimizer keeps views of them.
        return [p for p in self._module.parameters() if not p.requires_grad]

    def offload(self) -> None:
        import torch

        frozen = self._frozen()
        if not frozen:
            return
        self._home = frozen[0].device
        for param in frozen:
            param.data = param.data.to("cpu", non_blocking=True)
        if self._device == "gpu":
            if self._engine.zero_optimization_stage() > 0:
                self._engine.offload_states()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        else:
            release_freed_host_memory()

    def reload(self) -> None:
        if self._home is None:
            return
        for param in self._frozen():
            param.data = param.data.to(self._home, non_blocking=True)
        if self._device == "gpu" and self._engine.zero_optimization_stage() > 0:
            self._engine.reload_states()
        self._home = None
