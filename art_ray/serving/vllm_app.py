"""vLLM's own OpenAI server (FastAPI app + AsyncLLM), built in-process for a Serve replica.

art-ray does not re-implement chat templates, tool parsing, streaming or error handling: the routes,
validation and OpenAI error JSON are vLLM's. This module only turns an EngineConfig into vLLM's CLI
namespace and builds the engine and the app the way `vllm serve` does.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from art_ray.serving.config import ServingConfig
from art_ray.serving.vllm_logging import log_vllm_lines, logging_config_of_a_replica

# The base model is never served without an adapter (vLLM-CPU applies adapters to no-adapter requests
# batched with adapter ones); it is registered under this name and the middleware refuses it.
BASE_MODEL_NAME = "art-ray-base-model"


def vllm_namespace(config: ServingConfig) -> Namespace:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine_kwargs = config.engine.vllm_kwargs()
    # settings vLLM's parser checks (choices) go through it; the rest are set on the namespace it returns
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", engine_kwargs["model"], "--tool-strict-level", config.tool_strict_level]
    )
    for key, value in engine_kwargs.items():
        if not hasattr(args, key):
            raise ValueError(f"unknown vLLM engine argument {key!r}")
        if key == "structured_outputs_config" and isinstance(value, dict):
            # the CLI builds this config object from JSON; a config file gives a plain dict
            from vllm.config import StructuredOutputsConfig

            value = StructuredOutputsConfig(**value)
        setattr(args, key, value)
    args.served_model_name = [BASE_MODEL_NAME]
    # keys are judged by art-ray's gate in front of vLLM (endpoint_guard.py), run keys included, which
    # vLLM's own check (the admin key only, on /v1 only) would refuse
    args.api_key = None
    if config.tool_call_parser:
        args.enable_auto_tool_choice = True
        args.tool_call_parser = config.tool_call_parser
    if config.chat_template:
        args.chat_template = config.chat_template
    args.disable_uvicorn_access_log = True
    args.disable_log_stats = True
    args.logging_config = logging_config_of_a_replica()  # vllm_logging.py: no dictConfig here
    return args


def kv_cache_bytes_per_token(vllm_config: Any) -> int:
    """A key and a value per layer, for this engine's shape and cache dtype (fp8 caches: one byte)."""
    import torch

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    dtype = model.dtype if vllm_config.cache_config.cache_dtype == "auto" else torch.uint8
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * model.get_num_kv_heads(parallel) * model.get_head_size() * element
    return model.get_num_layers(parallel) * per_layer


async def build_engine_and_app(config: ServingConfig) -> tuple[Any, Any]:
    """Start an AsyncLLM and build vLLM's FastAPI app around it; returns (engine, app)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from art_ray.serving.cpu_fork import fork_engine_core
    from art_ray.serving.ipc_dir import own_ipc_dir

    config.engine.apply_env()
    own_ipc_dir()
    log_vllm_lines()
    args = vllm_namespace(config)
    if args.tool_call_parser and config.tool_call_max_whitespace is not None:
        from art_ray.serving.tool_grammar import bounded_whitespace_parser

        args.tool_call_parser = bounded_whitespace_parser(
            args.tool_call_parser, config.tool_call_max_whitespace
        )
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    if config.engine.resolved_device == "cpu":
        vllm_config.cache_config.kv_cache_memory_bytes = config.engine.cpu_kv_cache_bytes(
            kv_cache_bytes_per_token(vllm_config)
        )
        fork_engine_core()
    engine = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=False,
        disable_log_stats=True,
    )
    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks)
    return engine, app
