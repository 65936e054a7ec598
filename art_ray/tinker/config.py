"""TinkerConfig: the Tinker API on a training server (`art-ray serve-training --tinker`)."""

from __future__ import annotations

import pydantic

from art_ray.model_config import ModelConfig

TINKER_DEPLOYMENT = "TinkerFront"  # the Serve deployment of the front, which `art-ray status` asks


class TinkerConfig(pydantic.BaseModel):
    """`base_models`: what clients may name in create_lora_training_client (art-ray's local names, paths or
    hub ids; the first is the one the engines serve); `run_config`: each training client's run settings
    (its LoRA rank is the client's; runs on one base model share one trainer); a session whose client
    sends no heartbeat for `session_ttl_s` ends and its runs are deleted."""

    model_config = pydantic.ConfigDict(extra="forbid")

    base_models: list[str] = pydantic.Field(default_factory=lambda: ["smollm2-135m"], min_length=1)
    run_config: ModelConfig = pydantic.Field(default_factory=lambda: ModelConfig(share_trainer=True))
    session_ttl_s: float = pydantic.Field(default=300.0, gt=0)
    route_prefix: str = "/api/v1"
    app_name: str = "art-tinker"
