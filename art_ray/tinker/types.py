"""The seam between the Tinker API's HTTP front (art_ray/tinker/api.py: sessions, futures, keys, the
SDK's wire format) and the work behind it (`TinkerService`: the trainer and the engines).

On the types floor: pydantic only, no torch, Ray or `tinker` imports, so the trainer side needs none of
the SDK's packages.
"""

from __future__ import annotations

from typing import Literal, Protocol

import pydantic

from art_ray.errors import ArtRayError

# The losses art-ray computes (per token, summed over tokens and data, as Tinker defines them).
LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
LOSS_NAMES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


class TinkerUserError(ArtRayError, ValueError):
    """A Tinker request the client must change (an unknown base model, a rank too large, a malformed
    datum): answered as a failed future with category "user", which the SDK raises and does not retry."""


class LossDatum(pydantic.BaseModel):
    """One Tinker Datum, dense: position i of `tokens` predicts `target_tokens[i]`; every list has the
    length of `tokens`. `logprobs` are the sampler's, `weights` cross_entropy's per-token weights."""

    model_config = pydantic.ConfigDict(extra="forbid")

    tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None


class ForwardBackwardCall(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    data: list[LossDatum]
    loss_fn: LossName
    loss_fn_config: dict[str, float] = pydantic.Field(default_factory=dict)
    forward_only: bool = False


class ForwardBackwardResult(pydantic.BaseModel):
    """Per datum, per position: the learner's logprob of the target and that position's loss term;
    `metrics` keyed `name:reduction` as the SDK merges them (e.g. `loss:sum`)."""

    logprobs: list[list[float]]
    elementwise_loss: list[list[float]]
    metrics: dict[str, float]


class AdamStep(pydantic.BaseModel):
    """Tinker's AdamParams: decoupled weight decay; grad_clip_norm 0 means no clipping."""

    model_config = pydantic.ConfigDict(extra="forbid")

    learning_rate: float = pydantic.Field(default=1e-4, ge=0)
    beta1: float = pydantic.Field(default=0.9, ge=0, lt=1)
    beta2: float = pydantic.Field(default=0.95, ge=0, lt=1)
    eps: float = pydantic.Field(default=1e-12, gt=0)
    weight_decay: float = pydantic.Field(default=0.0, ge=0)
    grad_clip_norm: float = pydantic.Field(default=0.0, ge=0)


class TinkerModelSpec(pydantic.BaseModel):
    """A training client's run. `run` is the art-ray run (served on the OpenAI endpoint under that name);
    `owner` the run key's name that made it (None: the admin key)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    run: str
    base_model: str
    lora_rank: int = pydantic.Field(default=32, ge=1)
    seed: int | None = None
    owner: str | None = None


class TinkerModelInfo(pydantic.BaseModel):
    run: str
    base_model: str
    lora_rank: int
    tokenizer_id: str


class SamplerWeights(pydantic.BaseModel):
    """A saved adapter version: `served_name` (`run@step`) is what the engines sample; it never changes
    after it is made (a sampling client's snapshot)."""

    run: str
    step: int
    served_name: str


class SavedState(pydantic.BaseModel):
    """A run's training state saved under a name (`save_state`): what `create_training_client_from_state`
    needs to make a run like it, and who may load it."""

    run: str
    name: str
    step: int
    base_model: str
    lora_rank: int
    owner: str | None = None


class TinkerRunStatus(pydantic.BaseModel):
    """A Tinker training client's run, as `art-ray status` lists it: `run` is its art-ray run (the OpenAI
    endpoint's model name); `checkpoints` its sampler weights and saved training states, as tinker://
    paths."""

    model_id: str
    run: str
    owner: str | None
    base_model: str
    lora_rank: int
    checkpoints: list[str]


class SampleCall(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    model: str  # a served name: the base model or a snapshot's `run@step`
    prompt: list[int]
    num_samples: int = pydantic.Field(default=1, ge=1)
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    temperature: float = pydantic.Field(default=1.0, ge=0)
    top_k: int = -1
    top_p: float = pydantic.Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: list[str] | list[int] | None = None
    prompt_logprobs: bool = False


class SampledTokens(pydantic.BaseModel):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


class SampleResult(pydantic.BaseModel):
    sequences: list[SampledTokens]
    # one per prompt position; None where nothing is scored (the first)
    prompt_logprobs: list[float | None] | None = None


TINKER_VERBS = (
    "create_model",
    "forward_backward",
    "optim_step",
    "save_for_sampler",
    "save_state",
    "saved_state",
    "load_state",
    "sample",
    "unload",
)


class TinkerService(Protocol):
    """The work behind the Tinker routes. Calls of one run come in the client's `seq_id` order, one at a
    time; gradients of `forward_backward` calls add up until that run's `optim_step`. Raises
    TinkerUserError for what the client must change; anything else is a server error."""

    async def create_model(self, spec: TinkerModelSpec) -> TinkerModelInfo: ...

    async def forward_backward(self, run: str, call: ForwardBackwardCall) -> ForwardBackwardResult: ...

    async def optim_step(self, run: str, step: AdamStep) -> dict[str, float]: ...

    async def save_for_sampler(self, run: str) -> SamplerWeights: ...

    async def save_state(self, run: str, name: str) -> SavedState:
        """The run's adapter, optimizer state and step under `name` (replacing a state of that name)."""
        ...

    async def saved_state(self, run: str, name: str) -> SavedState | None:
        """What `save_state(run, name)` saved, also after the run ended; None if nothing was."""
        ...

    async def load_state(self, run: str, state: SavedState, optimizer: bool) -> int:
        """A saved state into `run` (its optimizer state too if `optimizer`); the run's step."""
        ...

    async def sample(self, call: SampleCall) -> SampleResult: ...

    async def unload(self, run: str) -> None: ...
