"""TrainConfig: the knobs of one GRPO training call (ART-compatible names where ART has them)."""

from __future__ import annotations

from typing import Literal

import pydantic


class TrainConfig(pydantic.BaseModel):
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

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
