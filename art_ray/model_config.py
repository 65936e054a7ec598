"""ModelConfig: per-model settings of a TrainableModel (adapter shape, trainer and serving sizes)."""

from __future__ import annotations

from typing import Literal

import pydantic

from art_ray.adapters.spec import LoRASpec


class ModelConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    lora: LoRASpec = pydantic.Field(default_factory=LoRASpec)
    # Placement (art_ray/placement.py), decided from the cluster's nodes, never the driver's devices.
    # "colocated": engine and trainer share the devices and take turns, each phase on all of them (one CPU
    # box, one GPU); "split": each on devices of its own. "auto": colocated where they would share anyway.
    layout: Literal["auto", "colocated", "split"] = "auto"
    # "auto": GPU when the nodes that can run the role have GPUs
    device: Literal["auto", "cpu", "gpu"] = "auto"
    # How long register() waits for an autoscaler to add nodes before it raises PlacementError.
    placement_timeout_s: float = pydantic.Field(default=600.0, ge=0)
    # trainer
    world_size: int = pydantic.Field(default=1, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = 0
    # Packed row length in tokens; a sequence longer than this is an error, never silently cut.
    sequence_length: int = pydantic.Field(default=2048, ge=16)
    # Rows per forward/backward on one rank; gradients accumulate over a rank's rows before the step.
    micro_batch_rows: int = pydantic.Field(default=4, ge=1)
    weight_decay: float = pydantic.Field(default=0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    adam_epsilon: float = pydantic.Field(default=1e-8, gt=0)
    trainer_cpus_per_rank: float = pydantic.Field(default=1.0, ge=0)
    trainer_gpus_per_rank: float | None = None  # None: 1 on GPU (0.5 colocated), 0 on CPU
    # None: every core of the node when colocated on CPU, else the CPUs the rank reserves
    trainer_threads: int | None = pydantic.Field(default=None, ge=1)
    # Custom Ray resources per trainer rank / inference replica: pin them to node types of the cluster
    # (cluster.yaml gives worker types resources such as {"trainer_node": 1}).
    trainer_resources: dict[str, float] = pydantic.Field(default_factory=dict)
    seed: int = 0
    # serving
    num_replicas: int = pydantic.Field(default=1, ge=1)
    max_model_len: int = pydantic.Field(default=2048, ge=16)
    keep_versions: int = pydantic.Field(default=3, ge=1)
    replica_cpus: float = pydantic.Field(default=1.0, ge=0)
    replica_gpus: float | None = None  # None: 1 per tensor-parallel rank on GPU (0.5 colocated), 0 on CPU
    replica_resources: dict[str, float] = pydantic.Field(default_factory=dict)
    # None: every core of the node when colocated on CPU, else the CPUs the replica reserves
    engine_threads: int | None = pydantic.Field(default=None, ge=1)
    tensor_parallel_size: int = pydantic.Field(default=1, ge=1)
    gpu_memory_utilization: float = pydantic.Field(default=0.85, gt=0, le=1)
    # vLLM's tool parser (None: "hermes" for the local models, whose template renders Hermes tool calls;
    # tool calls stay plain text for other models unless set, e.g. "hermes" for Qwen2.5, "llama3_json").
    tool_call_parser: str | None = None
    chat_template: str | None = None
