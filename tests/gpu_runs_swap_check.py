"""The run swap's GPU path on a real GPU: run with the device tool, not part of `make test` (no GPU here).

    python tests/gpu_runs_swap_check.py
    ART_RAY_MODELS_DIR=build/gpu_models python tests/bf16_runs_driver.py --device gpu

This script: PinnedHostMemory (art_ray/trainer/host_memory.py) on CUDA. A parked copy is pinned host
memory with the live tensor's values once `settle()` returns, even while the live tensor is overwritten
right after the asynchronous copy was issued; `restore` writes back in place (same storage); a fresh
buffer is reused; the CUDA generator's state comes back. The driver: RunStates with it around the GPU
rank's real DeepSpeed engine (bf16, fp32 masters in the mixed-precision wrapper, nccl): a run swapped
out between its steps ends with the adapter it trains alone.

Carried to the device (its image has torch, transformers and peft, not pydantic, DeepSpeed or Ray): the
prepared `tiny` model (`cp -r ~/.cache/art-ray/models/tiny build/gpu_models/`); the wheels for its Python
of pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions, click, rich, pygments,
markdown-it-py, mdurl and DeepSpeed's dependencies einops, hjson, msgpack, psutil, py-cpuinfo, ninja
(`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d
build/gpu_wheels ...`), installed there with `pip install --no-index --no-deps --target /tmp/pydeps
build/gpu_wheels/*.whl`; DeepSpeed's own package folder copied from the venv to build/gpu_ds/ (it ships
no wheel); PYTHONPATH=/tmp/pydeps:build/gpu_ds:. and DS_ACCELERATOR=cuda. Measured on an NVIDIA H200
(torch 2.11, cu130; DeepSpeed 0.19.8), 2026-11-28: every check here true; the driver's run "a" through
FP16_UnfusedOptimizer with its masters apart ends with the adapter it trains alone (difference 0.0,
moved 0.025).

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))


def check_pinned() -> dict:
    from art_ray.trainer.host_memory import PinnedHostMemory

    memory = PinnedHostMemory()
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


def main() -> None:
    results: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    results.update(check_pinned())
    for key, value in results.items():
        print(f"{key:>20}  {value}")
    print(json.dumps({"check": "gpu_runs_swap", **results}))


if __name__ == "__main__":
    main()
