"""The GPU memory plan against published model sizes and the cases register must refuse."""

import json
from typing import Any

import pytest

from art_ray.memory_plan import GiB, MemoryPlanError, ModelShape, check_fits, plan_gpu_memory


def hf_config(hidden: int, intermediate: int, layers: int, heads: int, kv: int, vocab: int, tied: bool, **x):
    return {
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "tie_word_embeddings": tied, **x,
    }  # fmt: skip


QWEN_7B = hf_config(3584, 18944, 28, 28, 4, 152064, False, model_type="qwen2")
QWEN_05B = hf_config(896, 4864, 24, 14, 2, 151936, True, model_type="qwen2")
LLAMA_8B = hf_config(4096, 14336, 32, 32, 8, 128256, False, model_type="llama", attention_bias=False)
SMOLLM_135M = hf_config(576, 1536, 30, 9, 3, 49152, True, model_type="llama")
LLAMA_70B = hf_config(8192, 28672, 80, 64, 8, 128256, False, model_type="llama")
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize(
    ("config", "published"),
    [(QWEN_7B, 7.62e9), (QWEN_05B, 0.494e9), (LLAMA_8B, 8.03e9), (SMOLLM_135M, 134.5e6), (LLAMA_70B, 70.6e9)],
)
def test_parameter_count_matches_published_size(config: dict[str, Any], published: float) -> None:
    assert ModelShape.from_hf_config(config).num_parameters == pytest.approx(published, rel=0.01)


def test_shape_defaults_and_model_dir(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM_135M, "num_key_value_heads": None}))
    shape = ModelShape.from_model_dir(tmp_path)
    assert (shape.head_dim, shape.num_key_value_heads) == (64, 9)  # hidden / heads; plain multi-head
    assert ModelShape.from_hf_config({**QWEN_7B, "head_dim": 256}).head_dim == 256


def test_kv_cache_bytes_per_token() -> None:
    shape = ModelShape.from_hf_config(QWEN_7B)
    assert shape.kv_cache_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2 == 57344
    assert shape.kv_cache_bytes_per_token(2, tensor_parallel_size=2) == 57344 // 2
    assert shape.kv_cache_bytes_per_token(2, tensor_parallel_size=8) == 2 * 28 * 1 * 128 * 2  # replicated


def test_lora_parameters() -> None:
    shape = ModelShape.from_hf_config(SMOLLM_135M)  # head_dim 64: q/o 576 wide, k/v 3 * 64 = 192
    per_layer = 16 * (576 + 576) * 2 + 16 * (576 + 192) * 2
    assert shape.lora_parameters(16, QKVO) == 30 * per_layer == 1_843_200
    mlp = 16 * (576 + 1536) * 3
    assert shape.lora_parameters(16, ["all-linear"]) == 30 * (per_layer + mlp)
    assert shape.lora_parameters(16, ["lm_head"]) == 16 * (576 + 49152)
    with pytest.raises(ValueError, match="embed_tokens"):
        shape.lora_parameters(16, ["embed_tokens"])


def plan(config: dict[str, Any] = QWEN_7B, **overrides: Any):
    settings: dict[str, Any] = {
        "layout": "colocated", "gpu_memory_bytes": 80 * GiB, "gpu_memory_utilization": 0.6,
        "max_model_len": 8192, "max_num_seqs": 64, "lora_r": 16, "lora_target_modules": QKVO,
        "sequence_length": 8192, "micro_batch_rows": 1,
    }  # fmt: skip
    return plan_gpu_memory(ModelShape.from_hf_config(config), **{**settings, **overrides})


def refused(**overrides: Any) -> MemoryPlanError:
    with pytest.raises(MemoryPlanError) as raised:
        check_fits(plan(**overrides))
    fixes = [problem.fixes[0] for problem in raised.value.problems]
    check_fits(plan(**{**overrides, **{k: v for fix in fixes for k, v in fix.items()}}))  # the fixes fit
    return raised.value


def message(error: MemoryPlanError) -> str:  # the problem lines, without the table
    return str(error).split("\nGPU (")[0]


def test_qwen_7b_fits_an_h100_colocated() -> None:
    fitting = plan()
    check_fits(fitting)
    assert fitting.kv_cache_tokens >= 8192 and fitting.training_peak < 80 * GiB
    assert fitting.engine_weights == fitting.trainer_weights == pytest.approx(7.62e9 * 2, rel=0.01)
    table = fitting.table()
    lines = ["GPU (colocated", "engine budget", "engine weights", "LoRA slots", "activation reserve",
             "KV cache", "engine CUDA context", "offloaded residual", "sampling peak", "sleeping residual",
             "trainer CUDA context", "base weights", "Adam", "activations", "attention mask", "logits",
             "training peak"]  # fmt: skip
    assert len(table.splitlines()) == len(lines)
    for label, row in zip(lines, table.splitlines(), strict=True):
        assert label in row and row.endswith(" GiB")


def test_engine_budget_and_trainer_residual_over_the_gpu_names_utilization() -> None:
    small = {"max_model_len": 2048, "sequence_length": 2048}
    error = refused(gpu_memory_bytes=24 * GiB, gpu_memory_utilization=0.97, **small)
    assert [p.phase for p in error.problems] == ["sampling"]
    assert error.problems[0].fixes == [{"gpu_memory_utilization": 0.95}]  # (24 - 0.5 - 0.5) / 24
    assert "gpu_memory_utilization=0.95" in str(error)


def test_kv_cache_shorter_than_max_model_len_names_utilization() -> None:
    # 0.25 * 80 GiB leaves ~3.5 GiB of KV cache beside the weights: ~65k tokens of 56 KiB
    error = refused(gpu_memory_utilization=0.25, max_model_len=131072)
    assert [p.phase for p in error.problems] == ["sampling"]
    assert "under max_model_len=131072; set gpu_memory_utilization=0.3" in message(error)
    with pytest.raises(MemoryPlanError):  # the suggestion is the smallest that fits
        check_fits(plan(gpu_memory_utilization=0.29, max_model_len=131072))


def test_qwen_7b_on_24_gib_at_default_utilization_fails_in_training_not_sampling() -> None:
    # 0.9 * 24 + 0.5 + 0.5 = 22.6 GiB: sampling fits; 8192 tokens of fp32 logits do not beside 14 GiB
    error = refused(gpu_memory_bytes=24 * GiB, gpu_memory_utilization=0.9)
    assert [p.phase for p in error.problems] == ["training"]
    assert "sequence_length=" in message(error) and "gpu_memory_utilization" not in message(error)


def test_long_rows_blow_up_the_logits_and_name_the_row_size() -> None:
    error = refused(sequence_length=65536, micro_batch_rows=4, max_model_len=32768)
    assert [p.phase for p in error.problems] == ["training"]
    assert "sequence_length=" in message(error) and "max_model_len=" in message(error)  # rows hold rollouts
    too_long = plan(sequence_length=65536, micro_batch_rows=4)
    assert too_long.trainer_logits > 500 * GiB and too_long.trainer_logits > too_long.trainer_activations


def test_rows_are_named_when_fewer_rows_fit() -> None:
    error = refused(micro_batch_rows=8)
    assert error.problems[0].fixes[0] == {"micro_batch_rows": 3}
    assert "micro_batch_rows=3; or set sequence_length=" in message(error)


def test_a_70b_model_names_tensor_parallelism_and_zero3() -> None:
    error = refused(config=LLAMA_70B, gpu_memory_utilization=0.9)
    assert [p.phase for p in error.problems] == ["sampling", "training"]
    assert "tensor_parallel_size=2" in message(error) and "zero_stage=3, world_size=4" in message(error)
    assert "max_model_len=" not in message(error)  # no shorter context makes 131 GiB of weights fit


def test_split_checks_each_side_against_its_own_gpu() -> None:
    gpu = {"gpu_memory_bytes": 40 * GiB, "gpu_memory_utilization": 0.98, "sequence_length": 4096}
    colocated, split = plan(**gpu), plan(**gpu, layout="split")  # split: 0.98 * 40 + 0.5 <= 40
    assert split.training_peak == colocated.training_peak - colocated.engine_sleeping_residual
    check_fits(split)
    with pytest.raises(MemoryPlanError, match="gpu_memory_utilization"):
        check_fits(colocated)


def test_gradient_checkpointing_keeps_one_layer() -> None:
    assert plan(gradient_checkpointing=False).trainer_activations > 10 * plan().trainer_activations


def test_the_cpu_plan_counts_float32_tensors_of_each_role() -> None:
    from art_ray import LoRASpec, ModelConfig
    from art_ray.memory_plan import plan_cpu_memory

    shape = ModelShape.from_hf_config(SMOLLM_135M)
    demo = ModelConfig(
        lora=LoRASpec(r=16, alpha=32), sequence_length=256, micro_batch_rows=1, max_model_len=512
    )
    plan = plan_cpu_memory(demo, shape, kv_cache_tokens=8192)
    assert plan.engine_weights == plan.trainer_weights == shape.num_parameters * 4
    assert plan.kv_cache == 8192 * 30 * 2 * 3 * 64 * 4  # what vLLM reported: 8,192 tokens in 0.35 GiB
    assert plan.trainer_tokens == 256
    four_rows = plan_cpu_memory(demo.model_copy(update={"micro_batch_rows": 4}), shape, kv_cache_tokens=8192)
    # activations and logits grow with the rows of a forward (the mask with their square length), all but
    # the step prefix's (up to half a row, once a step): at 4 rows the demo's trainer measured a 2.9 GiB
    # peak, at 1 row 1.7 GiB (runtime included)
    assert 3.1 < four_rows.trainer_activations / plan.trainer_activations < 3.4
    assert 0.6 * GiB < plan.trainer_activations < 1.0 * GiB
    assert "KV cache 0.35 GiB (8192 tokens)" in plan.engine_line()
    assert "256 tokens a forward" in plan.trainer_line() and "prefix of up to 128" in plan.trainer_line()


def test_register_prints_the_cpu_plan_of_a_local_model() -> None:
    from art_ray import ModelConfig, TrainableModel
    from art_ray.backend import RayBackend
    from art_ray.models import resolve_base_model
    from art_ray.placement import NodeShape, plan_model

    box = NodeShape(name="box", total={"CPU": 2}, available={"CPU": 2})
    config = ModelConfig(max_model_len=512, sequence_length=256, max_num_seqs=32)
    model = TrainableModel(name="m", project="p", base_model="smollm2-135m", config=config)
    lines = RayBackend._cpu_memory_plan(model, resolve_base_model("smollm2-135m"), plan_model(config, [box]))
    assert lines[0].startswith("memory plan on CPU")
    assert "KV cache 0.35 GiB (8192 tokens)" in lines[1] and lines[2].lstrip().startswith("trainer rank")
    # a hub id only the cluster's nodes can read: nothing is planned from the driver
    assert RayBackend._cpu_memory_plan(model, "org/not-here", plan_model(config, [box])) == []
