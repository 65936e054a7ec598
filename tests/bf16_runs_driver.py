"""Driver for tests/test_trainer_runs.py, run in its own process (DeepSpeed's process group is global).

The GPU trainer's engine (engine.build_engine in bf16): DeepSpeed wraps the AdamW in the mixed-precision
optimizer a GPU rank gets (fp32 masters apart from the bf16 adapter). Run "a" trains three steps on an
engine of its own, then on an engine founded by run "b" with run "c" beside it, swapped out between each
of its steps; each step's loss is scaled by a random draw, so the run's generator must come back too.
Prints, as its last line, one JSON object: the wrapper's name, whether the masters are other tensors
than the adapter, the largest difference between a's two adapters, and how far a's adapter moved.

    python tests/bf16_runs_driver.py               # DeepSpeed's CPU accelerator, gloo (the test's way)
    python tests/bf16_runs_driver.py --device gpu  # a real GPU: nccl, runs parked in pinned host memory

With `--device gpu` it runs where Ray is not installed (tests/gpu_runs_swap_check.py says what the device
tool carries there).
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch

from art_ray import ModelConfig
from art_ray.adapters.lora_files import initial_adapter
from art_ray.adapters.spec import LoRASpec
from art_ray.models import resolve_base_model
from art_ray.placement import Device, Reservation
from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.engine import build_engine
from art_ray.trainer.host_memory import host_memory
from art_ray.trainer.runs import RunStates

BASE = resolve_base_model("tiny")
SPEC = LoRASpec(r=4, alpha=8)
TOKENS = [1, 5, 9, 14, 3, 7, 2, 11, 4, 8, 6, 12]


def config(name: str, seed: int) -> TrainerConfig:
    return TrainerConfig(
        model=name,
        project="p",
        base_model=BASE,
        settings=ModelConfig(lora=SPEC, seed=seed, weight_decay=0.1),
        rank=Reservation(num_cpus=1.0),
        device="gpu",
    )


def engine_for(founder: TrainerConfig, device: Device):  # noqa: ANN201
    engine = build_engine(founder, bf16=True, dist_backend="nccl" if device == "gpu" else "gloo")
    return engine, RunStates(engine, founder, host_memory(device))


def train_step(engine, runs: RunStates, run: str) -> None:  # noqa: ANN001
    runs.activate(run)
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2
    tokens = torch.tensor([TOKENS], device=engine.device)
    # scaled by a draw from the run's generator (CUDA's on a GPU): a run whose RNG state is lost differs
    loss = engine(input_ids=tokens, labels=tokens).loss * (0.5 + torch.rand((), device=engine.device))
    engine.backward(loss)
    engine.step()


def adapter(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(engine.module)
    return {name: t.detach().float().cpu().clone() for name, t in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    device: Device = parser.parse_args().device
    torch.set_num_threads(1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }
    )

    alone, runs = engine_for(config("a", 0), device)
    for _ in range(3):
        train_step(alone, runs, "a")
    expected = adapter(alone)

    shared, runs = engine_for(config("b", 1), device)
    runs.add(config("a", 0))
    runs.add(config("c", 2))
    for run in ("b", "a", "c", "a", "b", "c", "a"):
        train_step(shared, runs, run)
    runs.activate("a")
    got = adapter(shared)
    start = initial_adapter(BASE, SPEC, 0)
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0) if device == "gpu" else "cpu",
                "wrapper": type(shared.optimizer).__name__,
                "masters_apart": len(runs._tensors()[1]) > 0,
                "max_difference": max((got[k] - expected[k]).abs().max().item() for k in expected),
                "moved": max((expected[k] - start[k].float()).abs().max().item() for k in expected),
            }
        )
    )


if __name__ == "__main__":
    main()
