"""The sampling parameters a choice was drawn with, as the endpoint records them on it.

A token sampled at temperature T comes from softmax(logits / T). The engine returns the logprob of that
distribution (vLLM's `processed_logprobs`), and the trainer computes its own logprobs, the reference
model's and the precalculated old ones at the same T, so the PPO ratio, its clip and the KL penalty are
those of the policy that sampled. top_p, top_k, seed and max_tokens are recorded for the record: the
trainer does not truncate its distribution (as TRL and verl do not), see `truncates`.

On the floor: pydantic only, no torch, ray or openai.
"""

from __future__ import annotations

from typing import Any

import pydantic

# The key of a served choice (and of a captured turn's choice) that holds its SamplingParams.
CHOICE_KEY = "sampling_params"
# vLLM samples greedily below this temperature and returns logprobs at temperature 1 for such a request
# (vllm/v1/sample/sampler.py, _SAMPLING_EPS); the trainer does the same.
GREEDY_BELOW = 1e-5
# OpenAI's and vLLM's default (the engine is told to ignore the model's generation_config: engine_config.py)
DEFAULT_TEMPERATURE = 1.0


class SamplingParams(pydantic.BaseModel):
    """What the engine sampled a choice with. `None`: the request did not set it (the engine's default:
    no truncation, no seed)."""

    model_config = pydantic.ConfigDict(extra="ignore", frozen=True)

    temperature: float = pydantic.Field(default=DEFAULT_TEMPERATURE, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None

    @classmethod
    def of_request(cls, payload: dict[str, Any]) -> SamplingParams | None:
        """The parameters of an OpenAI chat or text completion request body; None when one of them is not
        a valid value (the engine answers such a request with its own 400, so nothing is sampled)."""
        max_tokens = payload.get("max_tokens")
        if max_tokens is None:
            max_tokens = payload.get("max_completion_tokens")
        temperature = payload.get("temperature")
        try:
            return cls(
                temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
                top_p=payload.get("top_p"),
                top_k=payload.get("top_k"),
                seed=payload.get("seed"),
                max_tokens=max_tokens,
            )
        except pydantic.ValidationError:
            return None

    @property
    def training_temperature(self) -> float:
        """The temperature the trainer computes this choice's logprobs at: a greedy choice's are at 1,
        as the engine returned them."""
        return self.temperature if self.temperature >= GREEDY_BELOW else 1.0

    @property
    def truncates(self) -> bool:
        """Whether the engine sampled from a truncated distribution (top_p < 1 or top_k > 0), which the
        trainer does not reproduce: its logprobs are of the whole tempered distribution, so the ratio of
        such a token starts at p / p_truncated <= 1. `TrainConfig(precalculate_logprobs=True)` makes the
        ratio's denominator the trainer's own (ratio 1 at the step's start)."""
        return (self.top_p is not None and self.top_p < 1) or (self.top_k is not None and self.top_k > 0)

    def as_choice_field(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
