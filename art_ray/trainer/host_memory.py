"""Where a trainer rank keeps the runs that are not live: the one GPU-only part of swapping runs.

A run that waits keeps copies of its adapter, master weights and optimizer moments in host memory, and
the live run's tensors are overwritten in place when it goes live again (the optimizer wrappers keep
views of them, so they must stay the same tensors). On GPU the copies are pinned, so both directions are
asynchronous DMA on the current stream with one synchronize at the end; the CPU twin copies within host
memory, and its RNG is the CPU generator alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from art_ray.placement import Device

if TYPE_CHECKING:
    import torch


class HostMemory(Protocol):
    def park(self, live: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of `live` (into `into` when it has live's shape and dtype: a run keeps its buffers
        from one swap to the next)."""
        ...

    def restore(self, live: torch.Tensor, parked: torch.Tensor) -> None:
        """Copy `parked` back into `live`, in place."""
        ...

    def to_device(self, parked: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A new tensor on `device` holding `parked` (a state tensor the live run lacks)."""
        ...

    def settle(self) -> None:
        """Wait for the copies issued so far."""
        ...

    def rng_state(self) -> list[torch.Tensor]:
        """The generators a training step draws from."""
        ...

    def set_rng_state(self, state: list[torch.Tensor]) -> None: ...


def _fits(buffer: torch.Tensor | None, live: torch.Tensor) -> bool:
    return buffer is not None and buffer.shape == live.shape and buffer.dtype == live.dtype


class CPUHostMemory:
    """The twin: every tensor already lives on the host."""

    def park(self, live: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        if into is not None and _fits(into, live):
            return into.copy_(live)
        return live.detach().clone()

    def restore(self, live: torch.Tensor, parked: torch.Tensor) -> None:
        live.copy_(parked)

    def to_device(self, parked: torch.Tensor, device: torch.device) -> torch.Tensor:
        return parked.clone()

    def settle(self) -> None:
        return None

    def rng_state(self) -> list[torch.Tensor]:
        import torch

        return [torch.get_rng_state()]

    def set_rng_state(self, state: list[torch.Tensor]) -> None:
        import torch

        torch.set_rng_state(state[0])


class PinnedHostMemory:
    """GPU: page-locked host buffers, asynchronous copies both ways (tensors on the current device)."""

    def park(self, live: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        if live.device.type == "cpu":  # e.g. Adam's `step` counter, kept on the host by torch
            return CPUHostMemory().park(live, into)
        buffer = into if _fits(into, live) else torch.empty(live.shape, dtype=live.dtype, pin_memory=True)
        assert buffer is not None
        return buffer.copy_(live, non_blocking=True)

    def restore(self, live: torch.Tensor, parked: torch.Tensor) -> None:
        live.copy_(parked, non_blocking=live.device.type != "cpu")

    def to_device(self, parked: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return parked.clone()
        return parked.to(device, non_blocking=True)

    def settle(self) -> None:
        import torch

        torch.cuda.synchronize()

    def rng_state(self) -> list[torch.Tensor]:
        import torch

        return [torch.get_rng_state(), torch.cuda.get_rng_state()]

    def set_rng_state(self, state: list[torch.Tensor]) -> None:
        import torch

        torch.set_rng_state(state[0])
        torch.cuda.set_rng_state(state[1])


def host_memory(device: Device) -> HostMemory:
    return PinnedHostMemory() if device == "gpu" else CPUHostMemory()
