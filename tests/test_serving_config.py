"""Pure configuration logic of the serving layer (no engine)."""

import os
from pathlib import Path
from unittest import mock

import pydantic
import pytest
import yaml

from art_ray.adapters.spec import InvalidModelNameError, parse_versioned_name, versioned_name
from art_ray.serving.config import ServingConfig
from art_ray.serving.engine_config import EngineConfig


def test_engine_kwargs_for_cpu_and_gpu() -> None:
    cpu = EngineConfig(model="/m", device="cpu", threads=1)
    assert cpu.vllm_kwargs()["dtype"] == "float32"
    assert cpu.vllm_kwargs()["enforce_eager"] is True
    assert "tensor_parallel_size" not in cpu.vllm_kwargs()
    assert cpu.vllm_kwargs()["block_size"] == 32
    assert EngineConfig(model="/m", device="cpu", block_size=128).vllm_kwargs()["block_size"] == 128
    small_cache = EngineConfig(model="/m", device="cpu", cpu_kvcache_space_gib=0.125)
    assert small_cache.vllm_kwargs()["kv_cache_memory_bytes"] == 2**27
    assert cpu.env_vars() == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    every_core = EngineConfig(model="/m", device="cpu").env_vars()
    cores = sorted(os.sched_getaffinity(0))
    assert every_core["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert every_core["OMP_NUM_THREADS"] == str(len(cores))
    assert "libgomp" in every_core["LD_PRELOAD"]  # vLLM then pins one worker thread per listed core
    assert (
        EngineConfig(model="/m", device="cpu", cpu_threads_bind="auto").env_vars()[
            "VLLM_CPU_OMP_THREADS_BIND"
        ]
        == "auto"
    )
    gpu = EngineConfig(model="/m", device="gpu", tensor_parallel_size=2, gpu_memory_utilization=0.7)
    kwargs = gpu.vllm_kwargs()
    assert (kwargs["dtype"], kwargs["tensor_parallel_size"], kwargs["gpu_memory_utilization"]) == (
        "auto",
        2,
        0.7,
    )
    assert kwargs["enforce_eager"] is False
    assert "block_size" not in kwargs and "kv_cache_memory_bytes" not in kwargs
    assert gpu.env_vars() == {}


def test_cpu_kv_cache_is_sized_in_tokens() -> None:
    # 64 sequences of 2048 tokens by default, at 1000 bytes a token, rounded up to whole 32-token blocks
    assert EngineConfig(model="/m", device="cpu").cpu_kv_cache_bytes(1000) == 64 * 2048 * 1000
    sized = EngineConfig(model="/m", device="cpu", max_model_len=512, kv_cache_tokens=1000)
    assert sized.cpu_kv_cache_bytes(10) == 1024 * 10
    # never under one max_model_len sequence: vLLM refuses to start below it
    assert (
        EngineConfig(model="/m", device="cpu", max_model_len=512, kv_cache_tokens=16).cpu_kv_cache_bytes(1)
        == 512
    )
    gib = EngineConfig(model="/m", device="cpu", kv_cache_tokens=1000, cpu_kvcache_space_gib=0.25)
    assert gib.cpu_kv_cache_bytes(10) == 2**28


def test_kv_cache_bytes_per_token_from_the_engine_config() -> None:
    """What vLLM's own config says a token of the tiny model's cache takes: a key and a value per layer."""
    import json

    from vllm.engine.arg_utils import AsyncEngineArgs

    from art_ray.models import resolve_base_model
    from art_ray.serving.vllm_app import kv_cache_bytes_per_token, vllm_namespace

    base_model = resolve_base_model("tiny")
    config = ServingConfig(engine=EngineConfig(model=base_model, device="cpu", max_model_len=256, threads=1))
    # vLLM's CPU platform writes the engine's environment into this process while it builds the config
    # (LD_PRELOAD of torch's OpenMP, the worker start method); a Ray cluster a later test starts here
    # would hand it to every worker, and a trainer rank then ran one thread
    with mock.patch.dict(os.environ):
        vllm_config = AsyncEngineArgs.from_cli_args(vllm_namespace(config)).create_engine_config()
    shape = json.loads((Path(base_model) / "config.json").read_text())
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    expected = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * 4  # float32
    assert kv_cache_bytes_per_token(vllm_config) == expected


def test_vllm_namespace_accepts_every_engine_kwarg() -> None:
    from art_ray.serving.vllm_app import BASE_MODEL_NAME, vllm_namespace

    config = ServingConfig(engine=EngineConfig(model="/m", device="cpu"), api_key="k")
    args = vllm_namespace(config)
    assert args.model == "/m" and args.enable_lora is True and args.dtype == "float32"
    # keys are judged by the gate in front of vLLM, run keys included
    assert args.served_model_name == [BASE_MODEL_NAME] and args.api_key is None
    tools = vllm_namespace(
        ServingConfig(engine=EngineConfig(model="/m", device="cpu"), tool_call_parser="hermes")
    )
    assert tools.enable_auto_tool_choice is True and tools.tool_call_parser == "hermes"
    # a forced call's arguments follow the tool's schema by default, `strict` or not (vLLM's own is "auto")
    assert tools.tool_strict_level == "parameter"
    frame_only = ServingConfig(engine=EngineConfig(model="/m", device="cpu"), tool_strict_level="function")
    assert vllm_namespace(frame_only).tool_strict_level == "function"
    with pytest.raises(pydantic.ValidationError, match="tool_strict_level"):
        ServingConfig(engine=EngineConfig(model="/m", device="cpu"), tool_strict_level="strict")
    assert args.enable_auto_tool_choice is False
    compact = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    structured = vllm_namespace(
        ServingConfig(engine=EngineConfig(model="/m", device="cpu", extra_engine_kwargs=compact))
    )
    assert structured.structured_outputs_config.disable_any_whitespace is True
    with pytest.raises(ValueError, match="unknown vLLM engine argument"):
        unknown = {"no_such_arg": 1}
        vllm_namespace(
            ServingConfig(engine=EngineConfig(model="/m", device="cpu", extra_engine_kwargs=unknown))
        )


def test_keep_versions_cannot_exceed_lora_slots() -> None:
    with pytest.raises(pydantic.ValidationError, match="exceeds engine.max_loras"):
        ServingConfig(engine=EngineConfig(model="/m", max_loras=2), keep_versions=3)


@pytest.mark.parametrize(
    "bad", ["", "../x", "a/b", "x@", "x@-1", "x@1.5", "-x", "a..b", "x" * 200, None, 7, ["x"]]
)
def test_invalid_model_names_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidModelNameError):
        parse_versioned_name(bad)


def test_versioned_names_round_trip() -> None:
    assert parse_versioned_name(versioned_name("agent-1.v2", 12)) == ("agent-1.v2", 12)
    assert parse_versioned_name("agent") == ("agent", None)


def test_serve_config_file_builds_an_application(ray_cluster) -> None:
    from ray import serve

    from art_ray.serving.entrypoint import app_builder

    config = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "serve_config.yaml").read_text())
    args = config["applications"][0]["args"]
    args["engine"]["model"] = "/some/local/model"
    assert isinstance(app_builder(args), serve.Application)
    with pytest.raises(pydantic.ValidationError):
        app_builder({"engine": {"model": "/m"}, "num_replicas": 0})
