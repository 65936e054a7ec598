"""ModelConfig: per-model settings of a TrainableModel (adapter shape, trainer and serving sizes)."""

from __future__ import annotations

from typing import Literal

import pydantic

from art_ray.adapters.lora_files import LoRASpec


class ModelConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    lora: LoRASpec = pydantic.Field(default_factory=LoRASpec)
    # trainer
    world_size: int = pydantic.Field(default=1, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = 0
    sequence_length: int = pydantic.Field(default=2048, ge=16)
    micro_batch_rows: int = pydantic.Field(default=4, ge=1)
    trainer_cpus_per_rank: float = pydantic.Field(default=1.0, ge=0)
    trainer_gpus_per_rank: float | None = None  # None: 1 on a GPU cluster, 0 on CPU
    trainer_threads: int = pydantic.Field(default=1, ge=1)
    # Custom Ray resources per trainer rank / inference replica: pin them to node types of the cluster
    # (cluster.yaml gives worker types resources such as {"trainer_node": 1}).
    trainer_resources: dict[str, float] = pydantic.Field(default_factory=dict)
    seed: int = 0
    # serving
    num_replicas: int = pydantic.Field(default=1, ge=1)
    max_model_len: int = pydantic.Field(default=2048, ge=16)
    keep_versions: int = pydantic.Field(default=3, ge=1)
    replica_cpus: float = pydantic.Field(default=1.0, ge=0)
    replica_gpus: float | None = None  # None: 1 on a GPU cluster, 0 on CPU
    replica_resources: dict[str, float] = pydantic.Field(default_factory=dict)
    engine_threads: int | None = 1
    tensor_parallel_size: int = pydantic.Field(default=1, ge=1)
    gpu_memory_utilization: float = pydantic.Field(default=0.85, gt=0, le=1)
    # vLLM's tool parser (None: "hermes" for the local models, whose template renders Hermes tool calls;
    # tool calls stay plain text for other models unless set, e.g. "hermes" for Qwen2.5, "llama3_json").
    tool_call_parser: str | None = None
    chat_template: str | None = None
