"""What one GPU holds while the engine samples and while the trainer trains, checked at register time.

Pure arithmetic on a Hugging Face config.json: register runs on the driver, which may have neither a GPU
nor torch/vLLM. Estimates err a little high on purpose: a refusal at register names the setting to change,
an out-of-memory error an hour into a run names nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic

from art_ray.errors import ArtRayError
from art_ray.trainer.packing import MAX_STEP_PREFIX_SHARE

if TYPE_CHECKING:
    from art_ray.model_config import ModelConfig

GiB = 1024**3
# What a process with PyTorch's kernels loaded keeps on the GPU after freeing everything: the trainer's
# residual while offloaded, and the engine's outside its budget (vLLM wants util * total free at start).
CUDA_CONTEXT_BYTES = GiB // 2
# A level-1 sleeping engine keeps its context and what lives outside vLLM's sleep pool (CUDA graphs,
# cuBLAS workspaces, NCCL buffers).
ENGINE_SLEEPING_RESIDUAL_BYTES = GiB
# vLLM V1 chunks prefills, so the forward it profiles to size its activation reserve runs
# max_num_batched_tokens tokens (8192 by default for the server on large GPUs), whatever max_model_len is.
DEFAULT_BATCHED_TOKENS = 8192
# Inside vLLM's budget but outside its profiled forward: CUDA graphs, cuBLAS workspaces, NCCL buffers.
ENGINE_NON_TORCH_BYTES = GiB
# Sampler, per sequence and vocab entry: fp32 logits, probabilities, a sorted copy (top-p/k), logprobs.
SAMPLER_BYTES = 4 * 4
# Per LoRA parameter under DeepSpeed bf16: bf16 weight and grad (2+2), fp32 master weight and gradient
# accumulator (4+4), Adam's two fp32 moments (8).
LORA_STATE_BYTES = 20
# Saved by one decoder layer for backward, per token, in dtype-sized words: 16 of hidden width (the two
# RMSNorm inputs upcast to fp32, their outputs, q/k/v, attention and o_proj outputs, residual sums, LoRA
# inputs), 4 of intermediate width (gate, up, silu(gate), their product).
LAYER_HIDDEN_WORDS, LAYER_INTERMEDIATE_WORDS = 16, 4
# fp32 [tokens, vocab] buffers at the loss's peak beside the model's bf16 logits (kept for the entropy):
# log_softmax's output (saved for backward), then the gather's gradient and log_softmax's input gradient.
LOGITS_FP32_BUFFERS = 3


def _ceil2(x: float) -> float:  # utilizations are suggested with two decimals, rounded to the safe side
    return math.ceil(round(x * 100, 6)) / 100


def _floor2(x: float) -> float:
    return math.floor(round(x * 100, 6)) / 100


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


class ModelShape(pydantic.BaseModel):
    """The sizes of a llama/qwen2/mistral-style decoder that memory depends on."""

    model_config = pydantic.ConfigDict(frozen=True)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        config = config.get("text_config", config)  # multimodal configs nest the decoder's
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        return cls(
            num_layers=config["num_hidden_layers"], hidden_size=hidden,
            intermediate_size=config["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,  # absent: plain multi-head
            head_dim=config.get("head_dim") or hidden // heads,  # Mistral/Qwen3 may say otherwise
            vocab_size=config["vocab_size"], tie_word_embeddings=config.get("tie_word_embeddings", True),
            # Qwen2 has q/k/v biases without saying so in its config
            attention_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
        )  # fmt: skip

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear of one layer."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def num_parameters(self) -> int:
        per_layer = sum(a * b for a, b in self.linears().values()) + 2 * self.hidden_size  # + 2 RMSNorms
        if self.attention_bias:
            per_layer += (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + self.hidden_size  # + the final norm

    def lora_parameters(self, r: int, target_modules: list[str]) -> int:
        linears, names = self.linears(), set(target_modules)
        if "all-linear" in names:  # PEFT's "all-linear" leaves the output layer out
            names = (names - {"all-linear"}) | set(linears)
        if unknown := names - set(linears) - {"lm_head"}:
            raise ValueError(f"LoRA target modules {sorted(unknown)} are not linears of {sorted(linears)}")
        total = r * (self.hidden_size + self.vocab_size) if "lm_head" in names else 0
        return total + self.num_layers * r * sum(sum(linears[name]) for name in names - {"lm_head"})

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2, tensor_parallel_size: int = 1) -> int:
        # K and V of every layer; a tensor-parallel rank holds its share of the KV heads and at least one
        # (vLLM replicates KV heads when there are more ranks than heads)
        heads = -(-self.num_key_value_heads // tensor_parallel_size)
        return 2 * self.num_layers * heads * self.head_dim * dtype_bytes


class MemoryPlan(pydantic.BaseModel):
    """Bytes on one GPU. Colocated, the sampling phase adds the offloaded trainer's residual and the
    training phase the sleeping engine's; split, each side has its GPU to itself."""

    shape: ModelShape
    settings: dict[str, Any]  # plan_gpu_memory's keyword arguments: fixes are checked by re-planning
    layout: Literal["colocated", "split"]
    gpu_total: int
    engine_budget: int  # gpu_memory_utilization * total = weights + LoRA slots + reserve + KV cache
    engine_weights: int
    engine_lora_slots: int
    engine_activation_reserve: int
    kv_cache: int
    kv_cache_tokens: int
    engine_context: int
    engine_sleeping_residual: int
    trainer_context: int  # also its residual while offloaded
    trainer_weights: int
    trainer_lora_state: int
    trainer_activations: int
    trainer_attention_mask: int
    trainer_logits: int

    @property
    def sampling_peak(self) -> int:
        colocated = self.layout == "colocated"
        return self.engine_context + self.engine_budget + (self.trainer_context if colocated else 0)

    @property
    def trainer_peak(self) -> int:
        fixed = self.trainer_context + self.trainer_weights + self.trainer_lora_state
        return fixed + self.trainer_activations + self.trainer_attention_mask + self.trainer_logits

    @property
    def training_peak(self) -> int:
        return self.trainer_peak + (self.engine_sleeping_residual if self.layout == "colocated" else 0)

    def table(self) -> str:
        s, c, kv = self.settings, self.layout == "colocated", self.kv_cache
        rows = [
            (f"GPU ({self.layout}, per GPU)", self.gpu_total),
            (f"engine budget (gpu_memory_utilization={s['gpu_memory_utilization']})", self.engine_budget),
            (f"  engine weights (tensor_parallel_size={s['tensor_parallel_size']})", self.engine_weights),
            (f"  engine LoRA slots (max_loras={s['max_loras']})", self.engine_lora_slots),
            ("  engine activation reserve", self.engine_activation_reserve),
            (f"  KV cache ({self.kv_cache_tokens} tokens; max_model_len={s['max_model_len']})", kv),
            ("engine CUDA context", self.engine_context),
            ("trainer offloaded residual", self.trainer_context if c else 0),
            ("= sampling peak", self.sampling_peak),
            ("engine sleeping residual", self.engine_sleeping_residual if c else 0),
            ("trainer CUDA context", self.trainer_context),
            (f"trainer base weights (zero_stage={s['zero_stage']})", self.trainer_weights),
            ("trainer LoRA params + grads + Adam", self.trainer_lora_state),
            (f"trainer activations (checkpointing={s['gradient_checkpointing']})", self.trainer_activations),
            ("trainer attention mask", self.trainer_attention_mask),
            (f"trainer logits ({s['micro_batch_rows']} x {s['sequence_length']})", self.trainer_logits),
            ("= training peak", self.training_peak),
        ]
        return "\n".join(f"{label:<64}{_gib(n):>12}" for label, n in rows)


class Problem(pydantic.BaseModel):
    phase: Literal["sampling", "training"]
    why: str
    fixes: list[dict[str, Any]]  # alternatives, each a set of settings that fit together


class MemoryPlanError(ArtRayError, ValueError):
    def __init__(self, plan: MemoryPlan, problems: list[Problem]) -> None:
        self.plan, self.problems = plan, problems
        lines = [
            f"- {p.phase}: {p.why}; "
            + ("; or ".join("set " + ", ".join(f"{k}={v!r}" for k, v in f.items()) for f in p.fixes)
               or "no setting here fits: a smaller model or a larger GPU")
            for p in problems
        ]  # fmt: skip
        super().__init__("\n".join(["the GPU memory plan does not fit:", *lines, plan.table()]))


def plan_gpu_memory(
    shape: ModelShape, *, layout: Literal["colocated", "split"], gpu_memory_bytes: int,
    gpu_memory_utilization: float, max_model_len: int, max_num_seqs: int, lora_r: int,
    lora_target_modules: list[str], sequence_length: int, micro_batch_rows: int,
    tensor_parallel_size: int = 1, zero_stage: int = 0, world_size: int = 1, dtype_bytes: int = 2,
    max_loras: int = 4, max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS,
    engine_sleeping_residual_bytes: int = ENGINE_SLEEPING_RESIDUAL_BYTES,
    trainer_offloaded_residual_bytes: int = CUDA_CONTEXT_BYTES, gradient_checkpointing: bool = True,
) -> MemoryPlan:  # fmt: skip
    settings = {name: value for name, value in locals().items() if name != "shape"}
    tp, d, layers = tensor_parallel_size, dtype_bytes, shape.num_layers
    h, i = shape.hidden_size, shape.intermediate_size
    lora = shape.lora_parameters(lora_r, lora_target_modules)
    budget = int(gpu_memory_utilization * gpu_memory_bytes)
    engine_weights = shape.num_parameters * d // tp  # vLLM shards embeddings, lm_head and layers over tp
    engine_lora = max_loras * lora * d // tp  # vLLM allocates max_loras adapter slots at start
    # vLLM's profiled peak: one layer's replicated residual stream and sharded qkv/MLP outputs for
    # max_num_batched_tokens, the sampler over max_num_seqs rows, and what it measures outside torch
    reserve = max_num_batched_tokens * (4 * h + 3 * i // tp) * d + ENGINE_NON_TORCH_BYTES
    reserve += max_num_seqs * shape.vocab_size * SAMPLER_BYTES
    kv_cache = budget - engine_weights - engine_lora - reserve  # the KV cache gets what remains
    # ZeRO 0-2 keep the whole frozen base on each rank; ZeRO-3 shards it and gathers a layer at a time.
    shards = world_size if zero_stage == 3 else 1
    gathered = sum(a * b for a, b in shape.linears().values()) * d if shards > 1 else 0
    tokens = sequence_length * micro_batch_rows
    # a step's shared prefix (trainer/packing.py): its graph lives through the step, and every row's
    # tokens attend to its keys besides their own
    prefix = int(sequence_length * MAX_STEP_PREFIX_SHARE)
    full_layer = (tokens + prefix) * (LAYER_HIDDEN_WORDS * h + LAYER_INTERMEDIATE_WORDS * i) * d
    # checkpointing keeps each layer's input and rebuilds one layer's graph at a time in backward
    graphs = 1 if gradient_checkpointing else layers
    activations = (layers * (tokens + prefix) * h * d if gradient_checkpointing else 0) + graphs * full_layer
    return MemoryPlan(
        shape=shape, settings=settings, layout=layout, gpu_total=gpu_memory_bytes, engine_budget=budget,
        engine_weights=engine_weights, engine_lora_slots=engine_lora, engine_activation_reserve=reserve,
        kv_cache=kv_cache, kv_cache_tokens=max(0, kv_cache) // shape.kv_cache_bytes_per_token(d, tp),
        engine_context=CUDA_CONTEXT_BYTES, engine_sleeping_residual=engine_sleeping_residual_bytes,
        trainer_context=trainer_offloaded_residual_bytes,
        trainer_weights=shape.num_parameters * d // shards + gathered,
        trainer_lora_state=lora * LORA_STATE_BYTES // (world_size if zero_stage else 1),  # ZeRO 1+ shard it
        trainer_activations=activations,
        # the packed rows' boolean [rows, 1, L, prefix + L] mask lives through the step; SDPA's
        # memory-efficient kernel turns it into an additive bias of the activations' dtype, kept by every
        # layer's graph
        trainer_attention_mask=tokens * (prefix + sequence_length) * (1 + d * graphs),
        # logits at the trained positions only (worker.py), which is every position in the worst case (a row
        # of completions): bf16 logits plus fp32 buffers (LOGITS_FP32_BUFFERS)
        trainer_logits=tokens * shape.vocab_size * (d + 4 * LOGITS_FP32_BUFFERS),
    )  # fmt: skip


def _replan(plan: MemoryPlan, **changes: Any) -> MemoryPlan:
    return plan_gpu_memory(plan.shape, **{**plan.settings, **changes})


def _utilization_fix(plan: MemoryPlan) -> dict[str, Any] | None:
    """{} when the utilization fits, the one to use when another fits, None when none does. Low bound:
    vLLM refuses to start unless its KV cache holds one max_model_len sequence; high: vLLM wants util *
    total free at start, beside its own context and, colocated, the offloaded trainer's residual."""
    s, total = plan.settings, plan.gpu_total
    kv = s["max_model_len"] * plan.shape.kv_cache_bytes_per_token(s["dtype_bytes"], s["tensor_parallel_size"])
    low = _ceil2((plan.engine_budget - plan.kv_cache + kv) / total)
    high = _floor2((total - plan.sampling_peak + plan.engine_budget) / total)
    util = s["gpu_memory_utilization"]
    if low > high:
        return None
    return {} if low <= util <= high else {"gpu_memory_utilization": low if util < low else high}


def _largest(plan: MemoryPlan, name: str, step: int, fits: Callable[[MemoryPlan], bool]) -> int | None:
    """The largest multiple of step below a setting's value that fits (memory grows with the setting)."""
    low, high = 0, (plan.settings[name] - 1) // step
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(_replan(plan, **{name: middle * step})) else (low, middle - 1)
    return low * step or None


def _trains(plan: MemoryPlan) -> bool:
    return plan.training_peak <= plan.gpu_total


def _problems(plan: MemoryPlan) -> list[Problem]:
    s, problems, heads = plan.settings, [], plan.shape.num_attention_heads
    if util_fix := _utilization_fix(plan):
        why = f"the KV cache holds {plan.kv_cache_tokens} tokens, under max_model_len={s['max_model_len']}"
        if util_fix["gpu_memory_utilization"] < s["gpu_memory_utilization"]:
            why = f"the engine's {_gib(plan.engine_budget)} and CUDA contexts exceed {_gib(plan.gpu_total)}"
        problems.append(Problem(phase="sampling", why=why, fixes=[util_fix]))
    elif util_fix is None:
        fixes = []
        if length := _largest(plan, "max_model_len", 256, lambda p: _utilization_fix(p) is not None):
            fix = _utilization_fix(_replan(plan, max_model_len=length)) or {}
            fixes.append({"max_model_len": length} | fix)
        # vLLM splits the attention heads evenly over the ranks
        for tp in (t for t in (2, 4, 8) if t > s["tensor_parallel_size"] and heads % t == 0):
            if (fix := _utilization_fix(_replan(plan, tensor_parallel_size=tp))) is not None:
                fixes.append({"tensor_parallel_size": tp} | fix)
                break
        why = f"no gpu_memory_utilization fits max_model_len beside {_gib(plan.engine_weights)} of weights"
        problems.append(Problem(phase="sampling", why=why, fixes=fixes))
    if not _trains(plan):
        fixes = []
        if rows := _largest(plan, "micro_batch_rows", 1, _trains):
            fixes.append({"micro_batch_rows": rows})
        if length := _largest(plan, "sequence_length", 128, _trains):
            # a row holds a whole trajectory, so rollouts must get no longer than a row
            shorter = {"max_model_len": length} if length < s["max_model_len"] else {}
            fixes.append({"sequence_length": length} | shorter)
        if not fixes and plan.layout == "colocated" and _trains(_replan(plan, layout="split")):
            fixes.append({"layout": "split"})
        for world in (2, 4, 8) if not fixes else ():
            if _trains(_replan(plan, zero_stage=3, world_size=world)):  # shards the base weights
                fixes.append({"zero_stage": 3, "world_size": world})
                break
        why = f"the trainer's {_gib(plan.trainer_peak)} and engine residual exceed {_gib(plan.gpu_total)}"
        problems.append(Problem(phase="training", why=why, fixes=fixes))
    return problems


def check_fits(plan: MemoryPlan) -> None:
    if problems := _problems(plan):
        raise MemoryPlanError(plan, problems)


def plan_for_model(
    config: ModelConfig,
    shape: ModelShape,
    layout: Literal["colocated", "split"],
    gpu_memory_bytes: int,
    dtype_bytes: int = 2,
) -> MemoryPlan:
    """The plan of a model's settings as art-ray runs them (the engine's batch, LoRA slots, and a trainer
    without gradient checkpointing)."""
    return plan_gpu_memory(
        shape,
        layout=layout,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        lora_r=config.lora.r,
        lora_target_modules=list(config.lora.target_modules),
        sequence_length=config.sequence_length,
        micro_batch_rows=config.micro_batch_rows,
        tensor_parallel_size=config.tensor_parallel_size,
        zero_stage=config.zero_stage,
        world_size=config.world_size,
        max_loras=max(4, config.keep_versions),
        gradient_checkpointing=False,
        dtype_bytes=dtype_bytes,
    )


# fp32 on CPU: LoRA weight and gradient (4+4) and Adam's two moments (8); no master copy
CPU_LORA_STATE_BYTES = 16


class CPUMemoryPlan(pydantic.BaseModel):
    """The tensors of a CPU engine worker and trainer rank (float32 both), in bytes. Each process also
    holds its runtime (Python, torch, vLLM: bench/memory.py measures whole processes)."""

    engine_weights: int
    engine_lora_slots: int
    kv_cache: int
    kv_cache_tokens: int
    trainer_weights: int
    trainer_lora_state: int
    trainer_activations: int
    trainer_tokens: int
    trainer_step_prefix_tokens: int

    @property
    def engine(self) -> int:
        return self.engine_weights + self.engine_lora_slots + self.kv_cache

    @property
    def trainer(self) -> int:
        return self.trainer_weights + self.trainer_lora_state + self.trainer_activations

    def engine_line(self) -> str:
        return (
            f"engine worker {_gib(self.engine)}: weights {_gib(self.engine_weights)}, LoRA slots "
            f"{_gib(self.engine_lora_slots)}, KV cache {_gib(self.kv_cache)} ({self.kv_cache_tokens} tokens)"
        )

    def trainer_line(self) -> str:
        return (
            f"trainer rank {_gib(self.trainer)}: weights {_gib(self.trainer_weights)}, LoRA + Adam "
            f"{_gib(self.trainer_lora_state)}, activations and logits {_gib(self.trainer_activations)} "
            f"({self.trainer_tokens} tokens a forward: micro_batch_rows x sequence_length, after a step's "
            f"shared prefix of up to {self.trainer_step_prefix_tokens})"
        )


def plan_cpu_memory(config: ModelConfig, shape: ModelShape, kv_cache_tokens: int) -> CPUMemoryPlan:
    """What the engine and the trainer allocate for `config` on CPU: the GPU plan's arithmetic in float32,
    without gradient checkpointing (the CPU trainer's)."""
    d = 4
    gpu_plan = plan_for_model(config, shape, "split", gpu_memory_bytes=0, dtype_bytes=d)
    lora = shape.lora_parameters(config.lora.r, list(config.lora.target_modules))
    return CPUMemoryPlan(
        engine_weights=gpu_plan.engine_weights,
        engine_lora_slots=gpu_plan.engine_lora_slots,
        kv_cache=kv_cache_tokens * shape.kv_cache_bytes_per_token(d),
        kv_cache_tokens=kv_cache_tokens,
        trainer_weights=gpu_plan.trainer_weights,
        trainer_lora_state=lora * CPU_LORA_STATE_BYTES,
        trainer_activations=(
            gpu_plan.trainer_activations + gpu_plan.trainer_attention_mask + gpu_plan.trainer_logits
        ),
        trainer_tokens=config.sequence_length * config.micro_batch_rows,
        trainer_step_prefix_tokens=int(config.sequence_length * MAX_STEP_PREFIX_SHARE),
    )


def check_on_this_gpu(config: ModelConfig, base_model: str, layout: Literal["colocated", "split"]) -> str:
    """Runs on a GPU node (a Ray task): the plan against this GPU's memory; returns its table or raises
    MemoryPlanError naming what to change."""
    import torch
    from transformers import AutoConfig

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(base_model).to_dict())
    plan = plan_for_model(config, shape, layout, torch.cuda.get_device_properties(0).total_memory)
    check_fits(plan)
    return plan.table()
