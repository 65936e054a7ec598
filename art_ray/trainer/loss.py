"""GRPO math: group-normalized advantages and the clipped policy loss (PPO or CISPO) with optional KL.

Pure tensor code, no model: the trainer feeds it per-token log-probabilities of the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from art_ray.train_config import TrainConfig

STD_EPS = 1e-6


def group_advantages(rewards: list[float], scale: bool = True) -> list[float] | None:
    """(r - mean) / (std + eps), or only centred; None for a group with no reward variance."""
    if len(rewards) < 2:
        return None
    values = torch.tensor(rewards, dtype=torch.float64)
    centred = values - values.mean()
    std = values.std(unbiased=False)
    if float(std) < STD_EPS:
        return None
    return (centred / (std + STD_EPS) if scale else centred).tolist()


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # the scalar to backpropagate
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    trained_tokens: torch.Tensor


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config: TrainConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> PolicyLoss:
    """Per-token tensors of one shape; `weights` is 0 on context and padding, and sums to the share of
    the batch these tokens carry (each trajectory weighs the same, whatever its length)."""
    mask = weights > 0
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.epsilon, 1.0 + config.clip_high
    clipped_ratio = torch.clamp(ratio, low, high)
    if config.policy_loss == "cispo":
        # CISPO: the clipped ratio is a stop-gradient weight on the log-likelihood; no token is dropped.
        per_token = -clipped_ratio.detach() * advantages * logprobs
        clipped = (ratio != clipped_ratio) & mask
    else:
        unclipped_objective = ratio * advantages
        clipped_objective = clipped_ratio * advantages
        per_token = -torch.minimum(unclipped_objective, clipped_objective)
        clipped = (clipped_objective < unclipped_objective) & mask
    policy = (per_token * weights).sum()
    if ref_logprobs is not None and config.beta > 0:
        # k3 estimator of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1 >= 0
        delta = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = ((torch.exp(delta) - delta - 1) * weights).sum()
    else:
        kl = torch.zeros((), dtype=logprobs.dtype)
    total_weight = weights.sum().clamp_min(1e-12)
    return PolicyLoss(
        loss=policy + config.beta * kl,
        policy_loss=policy.detach(),
        kl=kl.detach(),
        clip_fraction=((clipped.float() * weights).sum() / total_weight).detach(),
        trained_tokens=mask.sum().detach(),
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) for each position: logits [..., T, V], targets [..., T]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)
