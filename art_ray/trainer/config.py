"""TrainerConfig: one model's trainer group (fixed for its life); crosses processes.

It carries the user's ModelConfig as it is (the one place its trainer settings live) and the placement
plan's decisions for the ranks, so no setting is copied under another name.
"""

from __future__ import annotations

import pydantic

from art_ray.adapters.spec import validate_model_name
from art_ray.model_config import ModelConfig
from art_ray.placement import Device, Reservation


class TrainerConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    model: str
    project: str
    base_model: str  # a resolved path or hub id
    # `{storage}/{project}/models/{model}/checkpoints/{step:04d}/`; a local folder or a pyarrow.fs URI
    storage: str = "./art_ray_runs"
    settings: ModelConfig = pydantic.Field(default_factory=ModelConfig)
    # From the placement plan: each rank's device and reservation, its torch threads (None: every core of
    # its node), and whether it shares its devices with engine replicas (then it hands them over).
    device: Device = "cpu"
    rank: Reservation = pydantic.Field(default_factory=lambda: Reservation(num_cpus=1.0))
    threads: int | None = pydantic.Field(default=1, ge=1)
    colocated: bool = False

    @pydantic.field_validator("model", "project")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return validate_model_name(value)

    def model_dir(self) -> str:
        return model_dir(self.storage, self.project, self.model)

    def checkpoint_dir(self, step: int) -> str:
        return f"{self.model_dir()}/checkpoints/{step:04d}"


def model_dir(storage: str, project: str, model: str) -> str:
    """`{storage}/{project}/models/{model}`: a run's checkpoints, trajectories and saved states."""
    return f"{storage.rstrip('/')}/{project}/models/{model}"
