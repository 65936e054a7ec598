"""GRPO math: the clipped policy loss (PPO or CISPO) with optional KL (advantages: batches.py).

Pure tensor code, no model: the trainer feeds it per-token log-probabilities of the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from art_ray.train_config import TrainConfig

# verl's bounds on the k3 KL estimator (core_algos.kl_penalty, "low_var_kl"): log-ratio and per-token term
KL_DELTA, KL_TOKEN_MAX = 20.0, 10.0


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
    segments: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
) -> PolicyLoss:
    """Per-token tensors of one shape [rows, tokens]; `weights` is 0 on context and padding, and sums to
    the share of the batch these tokens carry (each trajectory weighs the same, whatever its length).
    A NaN old logprob is a token sampled by the current policy (ratio 1: SFT, or a turn trained without
    logprobs). `segments` (each token's sequence within its row) is needed for sequence-level ratios.
    `sampler_logprobs`: the sampler's, when `old_logprobs` are the trainer's (precalculate_logprobs);
    truncated importance sampling then weighs each token by the sampler's distance from the old policy,
    as ART does."""
    mask = weights > 0
    old_logprobs = torch.where(torch.isnan(old_logprobs), logprobs.detach(), old_logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if config.importance_sampling_level == "sequence":
        if segments is None:
            raise ValueError("sequence-level importance sampling needs each token's segment")
        log_ratio = _sequence_mean(log_ratio, segments, mask)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.epsilon, 1.0 + config.clip_high
    if ref_logprobs is not None and config.kl_penalty_coef > 0:
        # ART's penalty: tokens that drifted from the base model more than the batch's mean lose advantage
        token_kl = torch.where(mask, (logprobs - ref_logprobs).detach(), torch.zeros_like(logprobs))
        mean_kl = token_kl.sum() / mask.sum().clamp_min(1)
        advantages = advantages + config.kl_penalty_coef * (mean_kl - token_kl) * mask
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
    if config.truncated_importance_sampling is not None:
        weight = ratio
        if sampler_logprobs is not None:
            sampled = torch.where(torch.isnan(sampler_logprobs), old_logprobs, sampler_logprobs)
            weight = torch.exp(torch.where(mask, old_logprobs - sampled, torch.zeros_like(logprobs)))
        per_token = per_token * torch.clamp(weight, max=config.truncated_importance_sampling).detach()
    policy = (per_token * weights).sum()
    if ref_logprobs is not None and config.beta > 0:
        # k3 estimator of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1 >= 0, each token's
        # bounded as verl's low_var_kl bounds it (delta to +-20, the term to 10). Unbounded, a token the
        # policy holds far less likely than the reference weighs exp(delta), and temperature < 1 multiplies
        # delta by 1/T: a step of the email agent at T 0.5 had a KL of 174 and a gradient norm of 734, the
        # rest of the step's gradient clipped away under it.
        # A bounded token carries no gradient.
        delta = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs)).clamp(
            -KL_DELTA, KL_DELTA
        )
        kl = (torch.clamp(torch.exp(delta) - delta - 1, max=KL_TOKEN_MAX) * weights).sum()
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


def _sequence_mean(values: torch.Tensor, segments: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each masked token's value replaced by the mean over the masked tokens of its (row, segment)."""
    rows, _ = values.shape
    per_row = int(segments.max()) + 1 if segments.numel() else 1
    keys = (torch.arange(rows, device=values.device).unsqueeze(1) * per_row + segments).reshape(-1)
    flat_mask = mask.reshape(-1)
    sums = torch.zeros(rows * per_row, dtype=values.dtype, device=values.device)
    counts = torch.zeros_like(sums)
    sums.index_add_(0, keys[flat_mask], values.reshape(-1)[flat_mask])
    counts.index_add_(0, keys[flat_mask], torch.ones_like(values.reshape(-1)[flat_mask]))
    means = sums / counts.clamp_min(1)
    return torch.where(mask, means[keys].reshape(values.shape), torch.zeros_like(values))


def trained_positions(weights: torch.Tensor) -> torch.Tensor:
    """The sequence positions [T] where any row of `weights` [B, T] trains a token (a row of padding
    alone keeps its first position, so the step still has a loss to run backward on)."""
    positions = weights.gt(0).any(0).nonzero().squeeze(-1)
    return positions if positions.numel() else torch.zeros(1, dtype=torch.long, device=weights.device)


def _tempered(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    logits = logits.float()
    return logits if temperatures is None else logits / temperatures.unsqueeze(-1)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(target) for each position under softmax(logits / T), each position at the temperature its
    token was sampled at: logits [..., T, V], targets and temperatures [..., T] (None: 1 everywhere).
    The one function for the trainer's logprobs, the reference model's and precalculated old ones."""
    log_probs = torch.log_softmax(_tempered(logits, temperatures), dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """The entropy of the distribution each position was sampled from."""
    log_probs = torch.log_softmax(_tempered(logits, temperatures), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)
