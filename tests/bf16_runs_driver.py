"""Driver for tests/test_trainer_runs.py, run in its own process (DeepSpeed's process group is global).

The GPU trainer's engine on the CPU accelerator: the `tiny` model in bf16 under `deepspeed_config(...,
on_gpu=True)`, so DeepSpeed wraps the AdamW in the mixed-precision optimizer a GPU rank gets (fp32
masters apart from the bf16 adapter). Run "a" trains three steps on an engine of its own, then on an
engine founded by run "b" with run "c" beside it, swapped out between each of its steps. Prints, as its
last line, one JSON object: the wrapper's name, whether the masters are other tensors than the adapter,
the largest difference between a's two adapters, and how far a's adapter moved.
"""

from __future__ import annotations

import json
import os
import socket

import torch

from art_ray import ModelConfig
from art_ray.adapters.lora_files import initial_adapter
from art_ray.adapters.spec import LoRASpec
from art_ray.models import resolve_base_model
from art_ray.placement import Reservation
from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.host_memory import CPUHostMemory
from art_ray.trainer.runs import RunStates
from art_ray.trainer.worker import deepspeed_config, skip_shared_memory_allreduce

BASE = resolve_base_model("tiny")
SPEC = LoRASpec(r=4, alpha=8)
INPUT = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11, 4, 8, 6, 12]])


def config(name: str, seed: int) -> TrainerConfig:
    return TrainerConfig(
        model=name,
        project="p",
        base_model=BASE,
        settings=ModelConfig(lora=SPEC, seed=seed, weight_decay=0.1),
        rank=Reservation(num_cpus=1.0),
        device="gpu",
    )


def engine_for(founder: TrainerConfig):  # noqa: ANN201
    import deepspeed
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.bfloat16)
    model = get_peft_model(model, SPEC.peft_config(BASE))
    set_peft_model_state_dict(model, initial_adapter(BASE, SPEC, founder.settings.seed))
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=1e-5,
        betas=founder.settings.adam_betas,
        eps=founder.settings.adam_epsilon,
        weight_decay=founder.settings.weight_decay,
    )
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(founder, on_gpu=True)
    )
    return engine, RunStates(engine, founder, CPUHostMemory())


def train_step(engine, runs: RunStates, run: str) -> None:  # noqa: ANN001
    runs.activate(run)
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2
    loss = engine(input_ids=INPUT, labels=INPUT).loss
    engine.backward(loss)
    engine.step()


def adapter(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from peft import get_peft_model_state_dict

    return {name: t.detach().float().clone() for name, t in get_peft_model_state_dict(engine.module).items()}


def main() -> None:
    import deepspeed

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
    skip_shared_memory_allreduce()
    deepspeed.init_distributed(dist_backend="gloo")

    alone, runs = engine_for(config("a", 0))
    for _ in range(3):
        train_step(alone, runs, "a")
    expected = adapter(alone)

    shared, runs = engine_for(config("b", 1))
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
                "wrapper": type(shared.optimizer).__name__,
                "masters_apart": len(runs._tensors()[1]) > 0,
                "max_difference": max((got[k] - expected[k]).abs().max().item() for k in expected),
                "moved": max((expected[k] - start[k].float()).abs().max().item() for k in expected),
            }
        )
    )


if __name__ == "__main__":
    main()
