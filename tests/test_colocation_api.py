"""The colocated hand-over against the real API surface of vLLM's AsyncLLM and DeepSpeed's engine (their
GPU calls cannot run here; their signatures and the call sequence can be checked)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from art_ray.colocation import EngineHandover, TrainerHandover


class SignatureCheckedEngine:
    """Records calls, each bound against the same method of vllm's AsyncLLM (a wrong name or argument
    fails here as it would on the real engine)."""

    def __init__(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._real = AsyncLLM
        self.calls: list[tuple[str, dict]] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        method = getattr(self._real, name)
        assert inspect.iscoroutinefunction(method), name

        async def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            bound = inspect.signature(method).bind(self, *args, **kwargs)
            self.calls.append((name, {k: v for k, v in bound.arguments.items() if k != "self"}))

        return call


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (
            "gpu",
            [
                ("sleep", {"level": 1, "mode": "wait"}),
                ("wake_up", {"tags": None}),
                ("reset_prefix_cache", {}),
            ],
        ),
        ("cpu", [("sleep", {"level": 0, "mode": "wait"}), ("wake_up", {"tags": ["scheduling"]})]),
    ],
)
def test_engine_handover_uses_vllms_sleep_api(device: str, expected: list) -> None:
    engine = SignatureCheckedEngine()
    handover = EngineHandover(engine, device)

    async def turns() -> None:
        await handover.reclaim()  # not released: nothing to do
        await handover.release()
        await handover.reclaim()

    asyncio.run(turns())
    assert engine.calls == expected


def test_deepspeed_engine_has_the_offload_calls_the_gpu_path_makes() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name in ("offload_states", "reload_states", "zero_optimization_stage"):
        assert callable(getattr(DeepSpeedEngine, name))
    assert "include" in inspect.signature(DeepSpeedEngine.offload_states).parameters


class StageZeroEngine:
    def zero_optimization_stage(self) -> int:
        return 0


def test_trainer_handover_moves_only_frozen_weights_and_keeps_the_parameters() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    module[0].weight.requires_grad_(False)
    frozen, trainable = module[0].weight, module[1].weight
    before = frozen.detach().clone()
    handover = TrainerHandover(module, StageZeroEngine(), "cpu")
    handover.offload()
    handover.reload()
    assert module[0].weight is frozen and module[1].weight is trainable  # optimizers keep their references
    torch.testing.assert_close(frozen.detach(), before)
    assert module(torch.ones(1, 4)).shape == (1, 2)
