"""TrainerConfig: how the trainer group is built (per model, fixed for its life); crosses processes."""

from __future__ import annotations

from typing import Literal

import pydantic

from art_ray.adapters.lora_files import LoRASpec, validate_model_name


class TrainerConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    model: str
    project: str
    base_model: str  # a resolved path or hub id
    lora: LoRASpec = pydantic.Field(default_factory=LoRASpec)
    # `{storage}/{project}/models/{model}/checkpoints/{step:04d}/`; a local folder or a pyarrow.fs URI
    storage: str = "./art_ray_runs"
    world_size: int = pydantic.Field(default=1, ge=1)
    device: Literal["auto", "cpu", "gpu"] = "auto"
    zero_stage: Literal[0, 1, 2, 3] = 0
    # Packed row length in tokens; a sequence longer than this is an error, never silently cut.
    sequence_length: int = pydantic.Field(default=1024, ge=16)
    # Rows per forward/backward on one rank; gradients accumulate over a rank's rows before the step.
    micro_batch_rows: int = pydantic.Field(default=4, ge=1)
    weight_decay: float = pydantic.Field(default=0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    seed: int = 0
    # Per rank: Ray CPUs (and threads of torch) and GPUs.
    num_cpus_per_rank: float = pydantic.Field(default=1.0, ge=0)
    torch_threads: int = pydantic.Field(default=1, ge=1)
    num_gpus_per_rank: float = pydantic.Field(default=0.0, ge=0)
    # Custom Ray resources per rank: pins the trainer to node types (e.g. {"trainer_node": 1}).
    resources_per_rank: dict[str, float] = pydantic.Field(default_factory=dict)

    @pydantic.field_validator("model", "project")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return validate_model_name(value)

    def model_dir(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.project}/models/{self.model}"

    def checkpoint_dir(self, step: int) -> str:
        return f"{self.model_dir()}/checkpoints/{step:04d}"
