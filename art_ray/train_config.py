"""TrainConfig: the knobs of one GRPO training call (ART-compatible names where ART has them)."""

from __future__ import annotations

import math
from typing import Literal

import pydantic


class TrainConfig(pydantic.BaseModel):
    """One GRPO train call's settings: learning rate, optimizer steps per call, the policy loss and its
    clip, KL penalty (`beta`), advantage scaling, old logprobs from the trainer or the engine. Invalid
    values raise pydantic's ValidationError when the config is made."""

    model_config = pydantic.ConfigDict(extra="forbid")

    learning_rate: float = pydantic.Field(default=5e-6, gt=0)
    # KL penalty against the base model (adapter disabled); 0 turns the reference forward pass off.
    beta: float = pydantic.Field(default=0.0, ge=0)
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    # Importance-ratio clip: [1 - epsilon, 1 + epsilon_high]; epsilon_high defaults to epsilon.
    epsilon: float = pydantic.Field(default=0.2, gt=0)
    epsilon_high: float | None = pydantic.Field(default=None, gt=0)
    # (r - mean) / (std + eps) when True; only centred (r - mean) when False.
    scale_rewards: bool = True
    max_grad_norm: float | None = pydantic.Field(default=1.0, gt=0)
    # Gradient steps per train call: the batch is split into this many optimizer steps.
    num_gradient_steps: int = pydantic.Field(default=1, ge=1)
    # The importance ratio per token, or one per sampled sequence (exp of its tokens' mean log-ratio, as
    # GSPO and ART's "sequence" level).
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # Multiply each token's loss by min(ratio, this) (a stop-gradient weight, as ART): off-policy samples
    # whose ratio grew large count less.
    truncated_importance_sampling: float | None = pydantic.Field(default=None, gt=0)
    # ART's KL penalty: each token's advantage moves by coef * (mean KL - its KL) against the base model
    # (adapter disabled); unlike `beta` it shapes advantages rather than adding a loss term.
    kl_penalty_coef: float = pydantic.Field(default=0.0, ge=0)
    # Old logprobs from the trainer (its policy before this call's first update) instead of the sampler's,
    # as ART's option of this name; the sampler's then only weigh tokens for truncated_importance_sampling.
    # For sampling the trainer cannot reproduce: a tool-call grammar (tool_choice "required" or a named
    # tool) renormalizes the engine's logprobs over the tokens it allows, so a forced token reads 0.0 and a
    # constrained choice's ratio is the probability of the allowed set, clipped as if it were off-policy.
    precalculate_logprobs: bool = False
    # The temperature every trained token's logprobs are taken at (new, old and the reference's). None: the
    # temperature it was sampled at, the gradient of the policy that sampled it, as TRL and verl train. A
    # number trains every token as if sampled at it: 1.0 is how ART (and art-ray before it recorded
    # temperatures) train; its gradient, on a token sampled at T < 1, is the tempered policy's plus a term
    # that sharpens the choices of rewarded rollouts and flattens those of the others (docs: "Sampling
    # temperature"). It needs precalculate_logprobs, so that the ratio still starts at 1.
    train_temperature: float | None = pydantic.Field(default=None, gt=0)
    # Packed row length for this call (None: ModelConfig.sequence_length).
    packed_sequence_length: int | None = pydantic.Field(default=None, ge=16)
    # Train assistant messages that carry no sampled tokens (plain dicts: tokens from the chat template),
    # as if sampled by the current policy (importance ratio 1).
    allow_training_without_logprobs: bool = False
    # Return once every live replica serves the new step (the next rollouts sample from it); False returns
    # once it is published, while the replicas load it (~0.08 s on the CPU box).
    wait_for_replicas: bool = True

    @pydantic.model_validator(mode="after")
    def _old_logprobs_at_the_train_temperature(self) -> TrainConfig:
        if self.train_temperature is not None and not self.precalculate_logprobs:
            raise ValueError(
                "train_temperature needs precalculate_logprobs=True: the engine's logprobs are those of the "
                "temperature it sampled at, so the ratio would not start at 1"
            )
        return self

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_reference(self) -> bool:
        """Whether the loss needs the base model's logprobs (a forward pass with the adapter off)."""
        return self.beta > 0 or self.kl_penalty_coef > 0


class SFTConfig(pydantic.BaseModel):
    """One supervised train call (ART's TrainSFTConfig): cross-entropy on the trajectories' assistant
    turns, `batch_size` trajectories per optimizer step; a list of learning rates gives one per step."""

    model_config = pydantic.ConfigDict(extra="forbid")

    learning_rate: float | list[float] = 5e-5
    # "auto": 2 trajectories per step, as ART's LocalBackend
    batch_size: int | Literal["auto"] = "auto"
    max_grad_norm: float | None = pydantic.Field(default=1.0, gt=0)

    @pydantic.field_validator("learning_rate")
    @classmethod
    def _positive(cls, value: float | list[float]) -> float | list[float]:
        rates = value if isinstance(value, list) else [value]
        if not rates or any(rate <= 0 for rate in rates):
            raise ValueError(f"learning_rate must be positive (or a non-empty list of them), got {value}")
        return value

    @pydantic.field_validator("batch_size")
    @classmethod
    def _batch(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"batch_size must be >= 1 or 'auto', got {value}")
        return value

    def steps(self, num_trajectories: int) -> list[float]:
        """The learning rate of each optimizer step over `num_trajectories` trajectories."""
        size = 2 if self.batch_size == "auto" else self.batch_size
        count = max(1, math.ceil(num_trajectories / size))
        if isinstance(self.learning_rate, list):
            if len(self.learning_rate) != count:
                raise ValueError(
                    f"learning_rate lists {len(self.learning_rate)} rates but {num_trajectories} "
                    f"trajectories in batches of {size} make {count} steps"
                )
            return list(self.learning_rate)
        return [self.learning_rate] * count
