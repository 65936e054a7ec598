"""A trainer rank's DeepSpeed engine: the base model with the run's step-0 LoRA, its AdamW, and the
process group, built the same way for a Ray trainer rank (worker.py) and for a driver that trains
without Ray (tests/bf16_runs_driver.py, which also runs on a real GPU). Imports no ray.

On GPU the model is bf16 and DeepSpeed wraps the AdamW in its mixed-precision optimizer (fp32 masters);
on CPU it is float32 and the AdamW steps the adapter itself. The process group's rendezvous
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) is the caller's to set.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import TYPE_CHECKING, Any, Literal

from art_ray.trainer.config import TrainerConfig

if TYPE_CHECKING:
    import torch


def init_loopback_process_group(dist_backend: str) -> None:
    """The process group of ranks on one machine whose rendezvous is loopback (an embedded cluster), with
    its store listening on loopback too: torch's TCPStore binds every interface unless it is handed a
    socket already bound, so rank 0 binds one to the rendezvous port on 127.0.0.1 and passes it on."""
    import datetime

    import torch.distributed

    if torch.distributed.is_initialized():  # a second engine in the same process joins the first's group
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    listener = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen()
    store = torch.distributed.TCPStore(
        address,
        port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(minutes=30),  # torch's default for process groups
        # the store owns the socket from here on (detach: Python would close it when collected)
        master_listen_fd=listener.detach() if listener is not None else None,
    )
    torch.distributed.init_process_group(dist_backend, store=store, rank=rank, world_size=world_size)


def skip_shared_memory_allreduce() -> None:
    """Keep DeepSpeed's CPU backend from loading its shared-memory all-reduce op.

    Only tensor-parallel inference uses that op; training reduces through gloo. Loading it takes a lock
    file under ~/.cache/torch_extensions in every process, even when the op is already built, and a
    process killed while holding it (a rank killed during setup) leaves the file behind: every later
    trainer on the machine then waits on it forever.
    """
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def deepspeed_config(config: TrainerConfig, on_gpu: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # Rows per rank vary from step to step: we own the accumulation boundary (engine.step()).
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": config.settings.zero_stage},
        "bf16": {"enabled": on_gpu},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _keep_only_trainable_in_state_dict(model: torch.nn.Module) -> None:
    """Checkpoints hold the adapter only: the base model is reloaded from its files. DeepSpeed's
    `exclude_frozen_parameters` misses tied weights (lm_head shares the embedding, so it is not in
    named_parameters) and would write the whole embedding matrix into every checkpoint."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}

    def drop_frozen(module: torch.nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for key in [key for key in state if key.startswith(prefix)]:
            if key[len(prefix) :] not in trainable:
                del state[key]

    model.register_state_dict_post_hook(drop_frozen)


def build_engine(config: TrainerConfig, bf16: bool, dist_backend: Literal["nccl", "gloo"]) -> Any:
    """The rank's DeepSpeed engine around the PEFT model, starting from exactly the step-0 adapter the
    replicas serve. `bf16`: the GPU trainer's precision and optimizer wrapper (on DeepSpeed's CPU
    accelerator too, where tests simulate a GPU rank)."""
    import deepspeed
    import torch
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from art_ray.adapters.lora_files import initial_adapter

    settings = config.settings
    model = AutoModelForCausalLM.from_pretrained(
        config.base_model, dtype=torch.bfloat16 if bf16 else torch.float32, attn_implementation="sdpa"
    )
    model = get_peft_model(model, settings.lora.peft_config(config.base_model))
    set_peft_model_state_dict(model, initial_adapter(config.base_model, settings.lora, settings.seed))
    _keep_only_trainable_in_state_dict(model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=1e-5,
        betas=settings.adam_betas,
        eps=settings.adam_epsilon,
        weight_decay=settings.weight_decay,
    )
    if dist_backend == "gloo":
        skip_shared_memory_allreduce()
    if ipaddress.ip_address(os.environ["MASTER_ADDR"]).is_loopback:
        init_loopback_process_group(dist_backend)  # DeepSpeed takes a process group already made
    deepspeed.init_distributed(dist_backend=dist_backend)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(config, bf16))
    return engine
