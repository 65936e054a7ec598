"""Driver for tests/test_step_prefix.py, run in its own process (DeepSpeed's process group is global).

Trains one GRPO call of synthetic groups that share a 48-token prefix, on trainer ranks of the `tiny`
model (TrainerWorker as the trainer group builds it, float32 on CPU), twice: with the step's prefix
computed once (`pack_step`'s default) and with it in every row. Rows of 96 tokens and one row per
micro-batch, so the prefix's gradient is gathered over several micro-batches. Two settings: plain GRPO,
and two gradient steps with a KL penalty against the base model (the trainer's own old logprobs and the
reference's forward read the prefix too). Prints, as its last line, one JSON object per setting: the
largest adapter difference between the two ways, how far the adapter moved, and rows and prefix sizes.
"""

from __future__ import annotations

import json
import socket

import torch
from factories import served_choice

from art_ray import ModelConfig, TrainConfig, Trajectory, TrajectoryGroup
from art_ray.adapters.spec import LoRASpec
from art_ray.models import resolve_base_model
from art_ray.placement import Reservation
from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.train_batch import rl_batches
from art_ray.trainer.worker import TrainerWorker

BASE = resolve_base_model("tiny")
PREFIX = [(7 * i) % 200 + 20 for i in range(48)]  # the system prompt every conversation starts with


def groups() -> list[TrajectoryGroup]:
    result = []
    for question in range(6):
        prompt = [*PREFIX, 230 + question, 240 + question, 250]
        trajectories = [
            Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "q"},
                    served_choice(
                        text="a",
                        token_ids=tuple(300 + 10 * question + (sample + k) % 7 for k in range(5 + sample)),
                        logprobs=tuple(-0.5 - 0.1 * k for k in range(5 + sample)),
                        prompt_token_ids=tuple(prompt),
                    ),
                ],
                reward=float((sample + question) % 3),
            )
            for sample in range(4)
        ]
        result.append(TrajectoryGroup(trajectories))
    return result


def worker(port: int) -> TrainerWorker:
    config = TrainerConfig(
        model="a",
        project="p",
        base_model=BASE,
        settings=ModelConfig(lora=LoRASpec(r=4, alpha=8), sequence_length=96, micro_batch_rows=1),
        rank=Reservation(num_cpus=1.0),
    )
    rank = TrainerWorker(config, 0)
    rank.setup("127.0.0.1", port)
    return rank


def train(port: int, train_config: TrainConfig, share_step_prefix: bool) -> tuple[dict, int, int]:
    rank = worker(port)
    [batch] = rl_batches(groups(), rank.tokenizer, train_config, 96, 1, share_step_prefix=share_step_prefix)
    list(rank.train("a", batch, train_config))
    adapter = {name: tensor.detach().clone() for name, tensor in rank.adapter_tensors("a").items()}
    return adapter, max(len(step.rows) for step in batch.steps), len(batch.steps[0].prefix)


def main() -> None:
    torch.set_num_threads(1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = {
        "plain": TrainConfig(learning_rate=1e-2, scale_rewards=False),
        "kl_two_steps": TrainConfig(
            learning_rate=1e-2, beta=0.1, num_gradient_steps=2, precalculate_logprobs=True
        ),
    }
    start = None
    results = {}
    for name, train_config in settings.items():
        shared, rows, prefix = train(port, train_config, share_step_prefix=True)
        every_row, rows_without, prefix_without = train(port, train_config, share_step_prefix=False)
        if start is None:
            start = {
                name: tensor.detach().clone() for name, tensor in worker(port).adapter_tensors("a").items()
            }
        results[name] = {
            "max_difference": max((shared[k] - every_row[k]).abs().max().item() for k in shared),
            "moved": max((shared[k] - start[k]).abs().max().item() for k in shared),
            "rows": [rows, rows_without],
            "prefix": [prefix, prefix_without],
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
