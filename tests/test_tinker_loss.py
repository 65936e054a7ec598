"""The Tinker losses' per-token terms and gradients against their definitions (tinker-docs /losses)."""

from __future__ import annotations

import math

import pytest
import torch

from art_ray.tinker.types import ForwardBackwardCall, LossDatum, TinkerUserError
from art_ray.trainer.tinker_loss import tinker_token_loss
from art_ray.trainer.tinker_step import check_call

SAMPLER = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
ADVANTAGES = torch.tensor([[1.0, -1.0, 1.0, 0.0]])
# ratios e^(p - q): 2, 2, 0.5, 1
LEARNER = SAMPLER + torch.tensor([[math.log(2), math.log(2), math.log(0.5), 0.0]])


def gradient(loss_fn: str, **config: float) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = LEARNER.clone().requires_grad_()
    terms = tinker_token_loss(
        loss_fn, logprobs, sampler_logprobs=SAMPLER, advantages=ADVANTAGES, config=config
    )
    terms.sum().backward()
    return terms.detach(), logprobs.grad


def test_cross_entropy_is_minus_weighted_logprob() -> None:
    logprobs = torch.tensor([[-0.5, -2.0, -1.0]], requires_grad=True)
    weights = torch.tensor([[0.0, 1.0, 0.5]])
    terms = tinker_token_loss("cross_entropy", logprobs, weights=weights)
    terms.sum().backward()
    assert terms.tolist() == [[0.0, 2.0, 0.5]]
    assert logprobs.grad.tolist() == [[0.0, -1.0, -0.5]]


def test_importance_sampling_is_minus_ratio_times_advantage() -> None:
    terms, grad = gradient("importance_sampling")
    assert terms[0].tolist() == pytest.approx([-2.0, 2.0, -0.5, 0.0])
    assert grad[0].tolist() == pytest.approx([-2.0, 2.0, -0.5, 0.0])  # d(-rA)/dp = -rA


def test_ppo_stops_the_gradient_where_the_clipped_objective_is_smaller() -> None:
    terms, grad = gradient("ppo")
    # A > 0 and r = 2 > 1.2: the clipped 1.2 * A; A < 0 and r = 2: unclipped -2; A > 0 and r = 0.5: 0.5
    assert terms[0].tolist() == pytest.approx([-1.2, 2.0, -0.5, 0.0])
    assert grad[0].tolist() == pytest.approx([0.0, 2.0, -0.5, 0.0])
    terms, _ = gradient("ppo", clip_low_threshold=0.9, clip_high_threshold=3.0)
    assert terms[0].tolist() == pytest.approx([-2.0, 2.0, -0.5, 0.0])


def test_cispo_weighs_the_logprob_by_the_clipped_ratio_without_its_gradient() -> None:
    terms, grad = gradient("cispo")
    clipped = [1.2, 1.2, 0.8, 1.0]
    assert grad[0].tolist() == pytest.approx(
        [-c * a for c, a in zip(clipped, ADVANTAGES[0].tolist(), strict=True)]
    )
    assert terms[0].tolist() == pytest.approx(
        [-c * p * a for c, p, a in zip(clipped, LEARNER[0].tolist(), ADVANTAGES[0].tolist(), strict=True)]
    )


def test_dro_penalises_the_squared_log_ratio() -> None:
    terms, grad = gradient("dro", beta=0.5)
    log_ratio = (LEARNER - SAMPLER)[0].tolist()
    expected = [
        -(p * a - 0.25 * d * d)
        for p, a, d in zip(LEARNER[0].tolist(), ADVANTAGES[0].tolist(), log_ratio, strict=True)
    ]
    assert terms[0].tolist() == pytest.approx(expected)
    assert grad[0].tolist() == pytest.approx(
        [-(a - 0.5 * d) for a, d in zip(ADVANTAGES[0].tolist(), log_ratio, strict=True)]
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (ForwardBackwardCall(data=[], loss_fn="cross_entropy"), "at least one datum"),
        (
            ForwardBackwardCall(
                data=[LossDatum(tokens=[1, 2], target_tokens=[2, 3])], loss_fn="cross_entropy"
            ),
            "needs loss_fn_inputs\\['weights'\\]",
        ),
        (
            ForwardBackwardCall(
                data=[LossDatum(tokens=[1, 2], target_tokens=[2, 3], weights=[1.0])], loss_fn="cross_entropy"
            ),
            "has 1 values for 2 tokens",
        ),
        (
            ForwardBackwardCall(
                data=[LossDatum(tokens=[1, 2], target_tokens=[2, 99], weights=[1.0, 1.0])],
                loss_fn="cross_entropy",
            ),
            "outside the vocabulary",
        ),
        (
            ForwardBackwardCall(
                data=[LossDatum(tokens=[1], target_tokens=[2], logprobs=[-1.0], advantages=[math.nan])],
                loss_fn="importance_sampling",
            ),
            "NaN",
        ),
        (
            ForwardBackwardCall(
                data=[LossDatum(tokens=[1], target_tokens=[2], logprobs=[-1.0], advantages=[1.0])],
                loss_fn="ppo",
                loss_fn_config={"beta": 1.0},
            ),
            "not taken by ppo",
        ),
        (
            ForwardBackwardCall(
                data=[LossDatum(tokens=[1] * 9, target_tokens=[2] * 9, weights=[1.0] * 9)],
                loss_fn="cross_entropy",
            ),
            "over this trainer's 8",
        ),
    ],
)
def test_a_call_the_trainer_cannot_compute_is_refused_with_its_reason(call, message) -> None:
    with pytest.raises(TinkerUserError, match=message):
        check_call(call, vocab_size=50, max_tokens=8)


@pytest.mark.parametrize("tinker_loss", ["importance_sampling", "ppo"])
def test_importance_sampling_and_ppo_are_grpos_loss_on_the_same_advantages(tinker_loss: str) -> None:
    """art-ray's GRPO loss (trainer/loss.py: PPO's clip, each token weighted by its trajectory's share) is
    Tinker's ppo with those weights folded into the advantages; with a clip range no ratio reaches, both
    are Tinker's importance_sampling. Same loss, same gradient."""
    from art_ray.train_config import TrainConfig
    from art_ray.trainer.loss import policy_loss

    generator = torch.Generator().manual_seed(0)
    sampler = -torch.rand(2, 6, generator=generator) * 3
    learner = sampler + torch.randn(2, 6, generator=generator) * 0.3  # ratios in and out of [0.8, 1.2]
    advantages = torch.tensor([[0.0, 0.0, 1.5, 1.5, 1.5, 0.0], [0.0, -0.5, -0.5, -0.5, -0.5, -0.5]])
    weights = torch.tensor([[0.0, 0.0, 1 / 6, 1 / 6, 1 / 6, 0.0], [0.0, 0.1, 0.1, 0.1, 0.1, 0.1]])
    epsilon = 0.2 if tinker_loss == "ppo" else 1e6
    config = TrainConfig(policy_loss="ppo", epsilon=epsilon, epsilon_high=epsilon)

    grpo_input = learner.clone().requires_grad_()
    grpo = policy_loss(grpo_input, sampler, advantages, weights, config).loss
    grpo.backward()
    tinker_input = learner.clone().requires_grad_()
    tinker = tinker_token_loss(
        tinker_loss, tinker_input, sampler_logprobs=sampler, advantages=advantages * weights
    ).sum()
    tinker.backward()
    assert tinker.item() == pytest.approx(grpo.item(), abs=1e-6)
    torch.testing.assert_close(tinker_input.grad, grpo_input.grad, atol=1e-6, rtol=1e-5)
    if tinker_loss == "ppo":  # some ratios were clipped: the test would not see a wrong clip otherwise
        ratio = torch.exp(learner - sampler)
        assert ((ratio > 1.2) & (advantages > 0)).any() or ((ratio < 0.8) & (advantages < 0)).any()
