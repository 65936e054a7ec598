"""Hand-built data shaped like what the art-ray endpoint returns (for unit tests of pure logic), and the
small `tiny` model config the SDK integration tests share."""

from __future__ import annotations

import os

from openai.types.chat.chat_completion import Choice

from art_ray import LoRASpec, ModelConfig

# Replica and trainer take no CPU reservation: on 2 cores the session's apps would not all schedule.
TINY_CONFIG = ModelConfig(
    lora=LoRASpec(r=8, alpha=16),
    sequence_length=256,
    max_model_len=512,
    replica_cpus=0,
    trainer_cpus_per_rank=0,
)


def cookbook_environment(tinker_key: str) -> dict[str, str]:
    """The environment a tinker-cookbook recipe runs in against art-ray here: offline, the key as the SDK
    reads it, no telemetry or W&B."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TINKER_API_KEY": tinker_key,
        "TINKER_TELEMETRY": "0",
        "WANDB_MODE": "disabled",
    }


def served_choice(
    text: str = "Paris",
    token_ids: tuple[int, ...] = (11, 12),
    logprobs: tuple[float, ...] = (-0.5, -0.25),
    prompt_token_ids: tuple[int, ...] | None = (1, 2, 3),
    with_token_ids: bool = True,
    tool_calls: list[dict] | None = None,
    sampling_params: dict | None = None,
) -> Choice:
    """A Choice as vLLM returns it with return_token_ids and return_tokens_as_token_ids."""
    data: dict = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": text, "tool_calls": tool_calls},
        "logprobs": {
            "content": [
                {"token": f"token_id:{token_id}", "logprob": logprob, "bytes": None, "top_logprobs": []}
                for token_id, logprob in zip(token_ids, logprobs, strict=True)
            ]
        },
    }
    if with_token_ids:
        data["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        data["prompt_token_ids"] = list(prompt_token_ids)
    if sampling_params is not None:
        data["sampling_params"] = sampling_params
    return Choice.model_validate(data)
