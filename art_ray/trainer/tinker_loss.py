"""The Tinker API's losses (tinker-docs /losses), per token and summed, as its clients' learning rates
assume: p is the learner's logprob of the target, q the sampler's (`logprobs`), r = exp(p - q), A the
advantage. Pure tensor code; art_ray/trainer/tinker_step.py feeds it.

- cross_entropy: -w * p
- importance_sampling: -r * A
- ppo: -min(r * A, clip(r, low, high) * A), with ratio bounds `clip_low_threshold` / `clip_high_threshold`
  (default 0.8 / 1.2, Tinker's fixed epsilon of 0.2)
- cispo: -stopgrad(clip(r, low, high)) * p * A
- dro: -(p * A - beta / 2 * (p - q)^2), `beta` from the call's config
"""

from __future__ import annotations

import torch

from art_ray.tinker.types import TinkerUserError

DEFAULT_CLIP_LOW, DEFAULT_CLIP_HIGH = 0.8, 1.2

# what each loss reads from a datum besides its targets, and the config keys it takes
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
}


def check_loss_config(loss_fn: str, config: dict[str, float]) -> None:
    unknown = sorted(set(config) - set(CONFIG_KEYS[loss_fn]))
    if unknown:
        allowed = ", ".join(CONFIG_KEYS[loss_fn]) or "none"
        raise TinkerUserError(
            f"loss_fn_config keys {unknown} are not taken by {loss_fn} (it takes: {allowed})"
        )
    if loss_fn == "dro" and "beta" not in config:
        raise TinkerUserError("the dro loss needs loss_fn_config['beta']")


def tinker_token_loss(
    loss_fn: str,
    logprobs: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    config: dict[str, float] | None = None,
) -> torch.Tensor:
    """Each position's loss term, of `logprobs`' shape; the loss is their sum. Padding positions must
    carry zero weights / advantages (their terms are then 0)."""
    config = config or {}
    if loss_fn == "cross_entropy":
        assert weights is not None
        return -weights * logprobs
    assert sampler_logprobs is not None and advantages is not None
    log_ratio = logprobs - sampler_logprobs
    ratio = torch.exp(log_ratio)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    low = config.get("clip_low_threshold", DEFAULT_CLIP_LOW)
    high = config.get("clip_high_threshold", DEFAULT_CLIP_HIGH)
    if loss_fn == "ppo":
        return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    if loss_fn == "cispo":
        return -torch.clamp(ratio, low, high).detach() * logprobs * advantages
    if loss_fn == "dro":
        return -(logprobs * advantages - config["beta"] / 2 * log_ratio**2)
    raise TinkerUserError(f"unknown loss {loss_fn!r}")
