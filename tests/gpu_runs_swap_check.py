"""The run swap's GPU path on a real GPU: run with the device tool, not part of `make test` (no GPU here).

    ART_RAY_MODELS_DIR=build/gpu_models python tests/gpu_runs_swap_check.py

Carried to the device (its image has torch, transformers and peft, but not pydantic): the prepared `tiny`
model (`cp -r ~/.cache/art-ray/models/tiny build/gpu_models/`) and the wheels of pydantic, pydantic-core,
annotated-types, typing-inspection, typing-extensions, click, rich, pygments, markdown-it-py and mdurl for
its Python (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux2014_x86_64 -d build/gpu_wheels ...`), installed there with `pip install --no-index --no-deps
--target /tmp/pydeps build/gpu_wheels/*.whl` and PYTHONPATH=/tmp/pydeps. Measured on an H200 (torch
2.11): every check true, a's adapter equal to the one it trained alone (difference 0.0, moved 0.03).

1. PinnedHostMemory (art_ray/trainer/host_memory.py) on CUDA: a parked copy is pinned host memory with
   the live tensor's values once `settle()` returns, even while the live tensor is overwritten right
   after the asynchronous copy was issued; `restore` writes back in place (same storage); a fresh buffer
   is reused; the CUDA generator's state comes back.
2. RunStates (art_ray/trainer/runs.py) with PinnedHostMemory on CUDA, the `tiny` model's LoRA in float32
   with a torch AdamW (the engine's module and optimizer; the device image has no DeepSpeed): run "a"
   trains three steps alone, then beside runs "b" and "c" on one model, swapped out between each of its
   steps; each step scales its loss by a draw from the CUDA generator, so a lost RNG state shows. a's
   adapters and draws must be equal.

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))


def _host_memory_module() -> types.ModuleType:
    """art_ray.trainer.host_memory; where the image lacks the SDK's own dependencies (pydantic, httpx),
    the file alone, with the one name it imports (placement.Device) given."""
    try:
        return importlib.import_module("art_ray.trainer.host_memory")
    except ImportError:
        for name in ("art_ray", "art_ray.placement"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["art_ray.placement"].Device = str  # type: ignore[attr-defined]
        path = Path(__file__).parents[1] / "art_ray" / "trainer" / "host_memory.py"
        spec = importlib.util.spec_from_file_location("host_memory", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in ("art_ray", "art_ray.placement"):
            del sys.modules[name]
        return module


def check_pinned() -> dict:
    memory = _host_memory_module().PinnedHostMemory()
    live = torch.randn(1 << 22, device="cuda")
    expected = live.clone()
    parked = memory.park(live)
    live.mul_(0)  # queued after the copy on the same stream: the parked copy must not see it
    memory.settle()
    pinned = parked.is_pinned() and parked.device.type == "cpu"
    park_equal = torch.equal(parked, expected.cpu())
    storage = live.data_ptr()
    memory.restore(live, parked)
    memory.settle()
    restore_equal = torch.equal(live, expected) and live.data_ptr() == storage
    again = memory.park(live * 2, into=parked)
    memory.settle()
    reused = again.data_ptr() == parked.data_ptr() and torch.equal(again, (expected * 2).cpu())
    moved = memory.to_device(parked, torch.device("cuda"))
    memory.settle()
    to_device = moved.device.type == "cuda" and torch.equal(moved, expected * 2)
    state = memory.rng_state()
    first = torch.rand(4, device="cuda")
    torch.rand(4, device="cuda")
    memory.set_rng_state(state)
    rng = torch.equal(first, torch.rand(4, device="cuda"))
    return {
        "pinned": pinned,
        "park_equal": park_equal,
        "restore_in_place": restore_equal,
        "buffer_reused": reused,
        "to_device": to_device,
        "cuda_rng_restored": rng,
    }


def _deepspeed_stand_in() -> None:
    """runs.unswappable imports DeepSpeed's mixed-precision wrapper to recognise it; the image has no
    DeepSpeed, and this check's optimizer is the torch one, so any class stands for the wrapper."""
    try:
        importlib.import_module("deepspeed.runtime.fp16.unfused_optimizer")
    except ImportError:
        module = types.ModuleType("deepspeed.runtime.fp16.unfused_optimizer")
        module.FP16_UnfusedOptimizer = type("FP16_UnfusedOptimizer", (), {})  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module


def check_runs() -> dict:
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from art_ray import ModelConfig
    from art_ray.adapters.lora_files import initial_adapter
    from art_ray.adapters.spec import LoRASpec
    from art_ray.models import resolve_base_model
    from art_ray.placement import Reservation
    from art_ray.trainer.config import TrainerConfig
    from art_ray.trainer.host_memory import PinnedHostMemory
    from art_ray.trainer.runs import RunStates

    _deepspeed_stand_in()
    base = resolve_base_model("tiny")
    spec = LoRASpec(r=4, alpha=8)
    tokens = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11, 4, 8, 6, 12]], device="cuda")

    def config(name: str, seed: int) -> TrainerConfig:
        return TrainerConfig(
            model=name,
            project="p",
            base_model=base,
            settings=ModelConfig(lora=spec, seed=seed, weight_decay=0.1),
            rank=Reservation(num_cpus=1.0, num_gpus=1.0),
            device="gpu",
        )

    def engine_for(founder: TrainerConfig) -> tuple[types.SimpleNamespace, RunStates]:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = get_peft_model(model, spec.peft_config(base))
        set_peft_model_state_dict(model, initial_adapter(base, spec, founder.settings.seed))
        model.to("cuda")
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=1e-2,
            betas=founder.settings.adam_betas,
            eps=founder.settings.adam_epsilon,
            weight_decay=founder.settings.weight_decay,
        )
        engine = types.SimpleNamespace(module=model, optimizer=optimizer, basic_optimizer=optimizer)
        return engine, RunStates(engine, founder, PinnedHostMemory())

    def train_step(engine: types.SimpleNamespace, runs: RunStates, run: str) -> float:
        runs.activate(run)
        draw = torch.rand((), device="cuda")
        loss = engine.module(input_ids=tokens, labels=tokens).loss * (0.5 + draw)
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        return draw.item()

    def adapter(engine: types.SimpleNamespace) -> dict[str, torch.Tensor]:
        state = get_peft_model_state_dict(engine.module)
        return {name: t.detach().float().cpu().clone() for name, t in state.items()}

    alone, runs = engine_for(config("a", 0))
    alone_draws = [train_step(alone, runs, "a") for _ in range(3)]
    expected = adapter(alone)

    shared, runs = engine_for(config("b", 1))
    runs.add(config("a", 0))
    runs.add(config("c", 2))
    shared_draws = []
    for run in ("b", "a", "c", "a", "b", "c", "a"):
        draw = train_step(shared, runs, run)
        if run == "a":
            shared_draws.append(draw)
    runs.activate("a")
    got = adapter(shared)
    start = initial_adapter(base, spec, 0)
    parked = runs._runs["b"].parked
    return {
        "max_difference": max((got[k] - expected[k]).abs().max().item() for k in expected),
        "moved": max((expected[k] - start[k].float()).abs().max().item() for k in expected),
        "draws_equal": alone_draws == shared_draws,
        "parked_pinned": parked is not None and all(t.is_pinned() for t in parked.adapter or []),
        "moments_on_gpu": all(
            value.device.type == "cuda"
            for state in shared.optimizer.state.values()
            for key, value in state.items()
            if key != "step"
        ),
    }


def main() -> None:
    results: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    results.update(check_pinned())
    try:
        results.update(check_runs())
    except ImportError as error:
        results["runs_check"] = f"not run: {error}"
    for key, value in results.items():
        print(f"{key:>20}  {value}")
    print(json.dumps({"check": "gpu_runs_swap", **results}))


if __name__ == "__main__":
    main()
