"""The config spine: ModelConfig and the placement plan become the serving and trainer configs in one
place (art_ray/role_configs.py), with no field renamed and no default drifting between classes."""

from __future__ import annotations

import pytest

from art_ray import LoRASpec, ModelConfig
from art_ray.placement import NodeShape, plan_model
from art_ray.role_configs import serving_config, trainer_config
from art_ray.serving.config import ServingConfig
from art_ray.serving.engine_config import EngineConfig
from art_ray.trainer.config import TrainerConfig


def node(name: str, cpus: float, gpus: float = 0) -> NodeShape:
    total = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return NodeShape(name=name, total=total, available=dict(total))


@pytest.mark.parametrize("role_config", [EngineConfig, ServingConfig, TrainerConfig])
def test_a_setting_shared_by_name_has_one_default(role_config: type) -> None:
    for name in set(ModelConfig.model_fields) & set(role_config.model_fields):
        if name == "device":  # the plan resolves "auto"; a TrainerConfig only ever holds a resolved one
            continue
        model_default = ModelConfig.model_fields[name].get_default(call_default_factory=True)
        role_default = role_config.model_fields[name].get_default(call_default_factory=True)
        assert model_default == role_default, f"{role_config.__name__}.{name} drifted from ModelConfig.{name}"


def build(config: ModelConfig, shapes: list[NodeShape]) -> tuple[ServingConfig, TrainerConfig]:
    plan = plan_model(config, shapes)
    serving = serving_config(
        config,
        plan,
        base_model="/m",
        app_name="app",
        route_prefix="/x",
        api_key="k",
        tool_call_parser="hermes",
    )
    trainer = trainer_config(config, plan, name="agent", project="p", base_model="/m", storage="/runs")
    return serving, trainer


def test_every_serving_setting_reaches_the_app() -> None:
    config = ModelConfig(
        lora=LoRASpec(r=32, alpha=64),
        max_model_len=777,
        seed=5,
        num_replicas=3,
        keep_versions=6,
        engine_threads=3,
        replica_cpus=2,
        replica_resources={"inference_node": 1},
        chat_template="{{ messages }}",
        tool_strict_level="function",
        default_max_tokens=100,
        max_n=4,
    )
    serving, trainer = build(
        config, [NodeShape(name="n", total={"CPU": 8, "inference_node": 1}, available={})]
    )
    engine = serving.engine
    assert (engine.max_model_len, engine.seed, engine.max_lora_rank, engine.threads) == (777, 5, 32, 3)
    assert engine.max_loras == 6 and engine.device == "cpu" and engine.colocated
    assert (serving.max_n, serving.default_max_tokens) == (4, 100)
    assert (serving.num_replicas, serving.keep_versions, serving.chat_template) == (3, 6, "{{ messages }}")
    assert (serving.replica_cpus, serving.replica_gpus, serving.replica_resources) == (
        2,
        0,
        {"inference_node": 1},
    )
    assert (serving.app_name, serving.route_prefix, serving.api_key) == ("app", "/x", "k")
    assert serving.tool_call_parser == "hermes"  # the family's parser when the user set none
    assert serving.tool_strict_level == "function"
    assert trainer.settings == config and trainer.colocated and trainer.device == "cpu"


def test_the_kv_cache_holds_the_runs_need() -> None:
    """max_num_seqs conversations of sequence_length tokens (no longer one trains), at least one of
    max_model_len; a value the user gives wins."""
    shapes = [node("box", 2)]
    demo = ModelConfig(sequence_length=256, max_model_len=512, max_num_seqs=32)
    assert build(demo, shapes)[0].engine.kv_cache_tokens == 32 * 256
    assert build(demo, shapes)[0].engine.max_num_seqs == 32
    short = ModelConfig(sequence_length=4096, max_model_len=1024, max_num_seqs=2)
    assert build(short, shapes)[0].engine.kv_cache_tokens == 2 * 1024
    few = ModelConfig(sequence_length=64, max_model_len=1024, max_num_seqs=1)
    assert build(few, shapes)[0].engine.kv_cache_tokens == 1024
    given = ModelConfig(kv_cache_tokens=5000)
    assert build(given, shapes)[0].engine.kv_cache_tokens == 5000


def test_a_gpu_plan_gives_gpu_engine_and_trainer_settings() -> None:
    config = ModelConfig(
        layout="split", tensor_parallel_size=2, gpu_memory_utilization=0.7, tool_call_parser="x"
    )
    serving, trainer = build(config, [node("head", 4), node("g", 16, gpus=4)])
    assert serving.engine.device == "gpu" and not serving.engine.colocated
    assert serving.replica_gpus == 2 and serving.engine.tensor_parallel_size == 2
    assert serving.engine.vllm_kwargs()["gpu_memory_utilization"] == 0.7
    assert serving.tool_call_parser == "x"  # the user's parser wins over the family's
    assert trainer.device == "gpu" and trainer.rank.num_gpus == 1 and not trainer.colocated
