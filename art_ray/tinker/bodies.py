"""The JSON request bodies the SDK sends (tinker/types/*_request.py), with the fields the front reads.

Unknown fields are ignored, so a newer SDK's additions do not break its requests; a known field of the
wrong type is refused (no coercion of `false` to 0); the fields that would change the answer and are not
served are refused where they are read.
"""

from __future__ import annotations

from typing import Any

import pydantic


class Body(pydantic.BaseModel):
    # strict: `"seq_id": false` or `"num_samples": "2"` is a client's bug to report, not a value to coerce
    model_config = pydantic.ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class SessionRef(Body):
    session_id: str


class ModelRef(Body):
    model_id: str


class LoraConfig(Body):
    rank: int = 32
    seed: int | None = None


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModel(Body):
    session_id: str
    model_seq_id: int = pydantic.Field(ge=0)
    base_model: str
    lora_config: LoraConfig | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig = pydantic.Field(default_factory=OptimizerConfig)


class OptimStep(Body):
    model_id: str
    seq_id: int
    adam_params: dict[str, Any] | None = None
    # a non-Adam optimizer's step (e.g. {"type": "dimuon", ...})
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsForSampler(Body):
    model_id: str
    seq_id: int
    path: str | None = None  # a name: a checkpoint kept under tinker://<model_id>/sampler_weights/<name>
    sampling_session_seq_id: int | None = None


class SaveWeights(Body):
    """save_state: the training state under a name, at tinker://<model_id>/weights/<name>."""

    model_id: str
    seq_id: int
    path: str | None = None


class LoadWeights(Body):
    """load_state (a model and its seq_id), or create_training_client_from_state (a session and the new
    model's seq id: the request makes the model)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = pydantic.Field(default=None, ge=0)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig | None = None


class ExternalWeights(Body):
    """save_weights_external, which is not served."""

    model_id: str | None = None
    seq_id: int | None = None


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class ModelInputChunk(Body):
    type: str = "encoded_text"
    tokens: list[int] = pydantic.Field(default_factory=list)


class ModelInput(Body):
    chunks: list[ModelInputChunk]


class SamplingParams(Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


# as the OpenAI endpoint's `n` (ServingConfig.max_n): one request must not hold the engine, or the
# front's memory, for as many sequences as a client cares to ask
MAX_SAMPLES = 128


class Sample(Body):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: int = pydantic.Field(default=1, ge=1, le=MAX_SAMPLES)
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = None
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool | None = None


class RetrieveFuture(Body):
    request_id: str
