"""The config spine: a model's settings (ModelConfig) and its placement plan become the serving app's and
the trainer group's configs here, and nowhere else.

Settings keep their ModelConfig names in the role configs (a field of the same name means the same thing
and has the same default; tests/test_role_configs.py holds that). What the plan decides (devices,
reservations, threads, layout) comes from the plan, never from the driver's own devices.
"""

from __future__ import annotations

from art_ray.model_config import ModelConfig
from art_ray.placement import ModelPlan
from art_ray.serving.config import ServingConfig
from art_ray.serving.engine_config import EngineConfig
from art_ray.trainer.config import TrainerConfig


def serving_config(
    config: ModelConfig,
    plan: ModelPlan,
    *,
    base_model: str,
    app_name: str,
    route_prefix: str,
    api_key: str | None,
    tool_call_parser: str | None,
) -> ServingConfig:
    """The inference app for a model's base model; `tool_call_parser` is the parser the model's family
    needs when the user set none (ModelConfig.tool_call_parser wins)."""
    engine = EngineConfig(
        model=base_model,
        device=plan.engine_device,
        colocated=plan.layout == "colocated",
        # an engine loads adapters up to the rank of the model that started it
        max_lora_rank=config.lora.r,
        max_loras=max(EngineConfig.model_fields["max_loras"].default, config.keep_versions),
        threads=plan.engine_threads,
        kv_cache_tokens=kv_cache_tokens(config),
        **config.model_dump(include=_shared(EngineConfig) - {"kv_cache_tokens"}),
    )
    return ServingConfig(
        engine=engine,
        app_name=app_name,
        route_prefix=route_prefix,
        api_key=api_key,
        replica_cpus=plan.replica.num_cpus,
        replica_gpus=plan.replica.num_gpus,
        replica_resources=plan.replica.resources,
        **config.model_dump(include=_shared(ServingConfig) - {"tool_call_parser"}),
        tool_call_parser=config.tool_call_parser or tool_call_parser,
    )


def kv_cache_tokens(config: ModelConfig) -> int:
    """A CPU engine's KV cache: the user's, else max_num_seqs conversations of sequence_length tokens (no
    longer one can be trained), at least one of max_model_len (vLLM's floor)."""
    if config.kv_cache_tokens is not None:
        return config.kv_cache_tokens
    return max(config.max_num_seqs * min(config.sequence_length, config.max_model_len), config.max_model_len)


def trainer_config(
    config: ModelConfig, plan: ModelPlan, *, name: str, project: str, base_model: str, storage: str
) -> TrainerConfig:
    return TrainerConfig(
        model=name,
        project=project,
        base_model=base_model,
        storage=storage,
        settings=config,
        device=plan.trainer_device,
        rank=plan.trainer_rank,
        threads=plan.trainer_threads,
        colocated=plan.layout == "colocated",
    )


# ModelConfig fields the plan resolves (e.g. replica_gpus=None -> 0.5 colocated on a GPU)
_PLANNED = {"replica_cpus", "replica_gpus", "replica_resources", "device", "layout"}


def _shared(role_config: type) -> set[str]:
    """ModelConfig fields a role config takes as they are (same name, same meaning)."""
    return (set(ModelConfig.model_fields) & set(role_config.model_fields)) - _PLANNED
