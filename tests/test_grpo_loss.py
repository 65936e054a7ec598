"""GRPO math against a plain-Python reference on hand-built tensors."""

import math

import pytest
import torch

from art_ray.train_config import TrainConfig
from art_ray.trainer.batches import group_advantages
from art_ray.trainer.loss import policy_loss


def reference_advantages(rewards: list[float], scale: bool) -> list[float] | None:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < 1e-6:
        return None
    return [(r - mean) / (std + 1e-6) if scale else r - mean for r in rewards]


def reference_loss(logp, old, adv, w, config: TrainConfig, ref=None) -> tuple[float, float, float]:
    policy = kl = clipped_weight = 0.0
    for lp, olp, a, weight, rlp in zip(logp, old, adv, w, ref or [0.0] * len(logp), strict=True):
        if weight == 0:
            continue
        ratio = math.exp(lp - olp)
        clipped = min(max(ratio, 1 - config.epsilon), 1 + config.clip_high)
        if config.policy_loss == "ppo":
            objective = min(ratio * a, clipped * a)
            clipped_weight += weight if clipped * a < ratio * a else 0.0
        else:
            objective = clipped * a * lp
            clipped_weight += weight if clipped != ratio else 0.0
        policy += -objective * weight
        if ref is not None:
            kl += (math.exp(rlp - lp) - (rlp - lp) - 1) * weight
    return policy, kl, clipped_weight / sum(w)


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_reference(scale: bool) -> None:
    rewards = [0.0, 1.0, 0.5, 1.0]
    assert group_advantages(rewards, scale) == pytest.approx(reference_advantages(rewards, scale))


def test_zero_variance_and_single_member_groups_have_no_advantages() -> None:
    assert group_advantages([1.0, 1.0, 1.0]) is None
    assert group_advantages([0.3]) is None


LOGP = [-1.0, -0.5, -2.0, -0.1, -3.0]
# old logprobs chosen so ratios are ~1 (inside the clip), 1.65 (above), 0.37 (below), and context
OLD_INSIDE = [-1.05, -0.45, -2.0, -0.1, -3.0]
OLD_CLIPPING = [-1.5, -0.5, -1.0, -0.1, -3.0]
ADV = [1.0, 1.0, -1.0, -1.0, 0.5]
WEIGHTS = [0.25, 0.25, 0.25, 0.25, 0.0]  # last token is context


@pytest.mark.parametrize("loss_kind", ["ppo", "cispo"])
@pytest.mark.parametrize("old", [OLD_INSIDE, OLD_CLIPPING], ids=["clip-inactive", "clip-active"])
@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["kl-off", "kl-on"])
def test_policy_loss_matches_reference(loss_kind: str, old: list[float], beta: float) -> None:
    config = TrainConfig(policy_loss=loss_kind, epsilon=0.2, epsilon_high=0.28, beta=beta)
    ref = [-1.2, -0.4, -2.5, -0.3, -3.0] if beta else None
    logp = torch.tensor(LOGP, requires_grad=True)
    result = policy_loss(
        logp,
        torch.tensor(old),
        torch.tensor(ADV),
        torch.tensor(WEIGHTS),
        config,
        None if ref is None else torch.tensor(ref),
    )
    expected_policy, expected_kl, expected_clip = reference_loss(LOGP, old, ADV, WEIGHTS, config, ref)
    assert result.policy_loss.item() == pytest.approx(expected_policy, rel=1e-5)
    assert result.kl.item() == pytest.approx(expected_kl, rel=1e-5, abs=1e-7)
    assert result.loss.item() == pytest.approx(expected_policy + beta * expected_kl, rel=1e-5)
    assert result.clip_fraction.item() == pytest.approx(expected_clip)
    assert result.trained_tokens.item() == 4
    result.loss.backward()
    assert logp.grad[4] == 0  # context gets no gradient
    if old is OLD_CLIPPING and loss_kind == "ppo" and beta == 0:
        # ratio 1.65 with A > 0 is clipped: no gradient through that token
        assert logp.grad[0] == 0
        assert result.clip_fraction.item() > 0
    if old is OLD_INSIDE:
        assert result.clip_fraction.item() == 0


def test_a_token_far_below_the_reference_is_bounded_in_the_kl_and_carries_no_gradient() -> None:
    """verl's bounds on k3: a token whose logprob fell 12 below the reference's counts 10, not
    exp(12) - 13, and moves nothing; the others keep their exact term and gradient."""
    config = TrainConfig(beta=0.1)
    ref = [-1.2, -0.4, -2.5, -0.3, -3.0]
    far = [-1.0, -0.5, -14.5, -0.2, -2.0]  # token 2: ref - logp = 12
    logp = torch.tensor(far, requires_grad=True)
    result = policy_loss(
        logp, torch.tensor(far), torch.zeros(5), torch.tensor(WEIGHTS), config, torch.tensor(ref)
    )
    terms = [math.exp(r - lp) - (r - lp) - 1 for r, lp in zip(ref, far, strict=True)]
    expected = sum(w * min(t, 10.0) for w, t in zip(WEIGHTS, terms, strict=True))
    assert terms[2] > 1e5 and result.kl.item() == pytest.approx(expected, rel=1e-5)
    result.loss.backward()
    assert logp.grad[2] == 0
    assert logp.grad[0] == pytest.approx(0.1 * 0.25 * (1 - math.exp(ref[0] - far[0])), rel=1e-5)


def test_clipped_cispo_tokens_still_get_gradient() -> None:
    config = TrainConfig(policy_loss="cispo")
    logp = torch.tensor(LOGP, requires_grad=True)
    policy_loss(
        logp, torch.tensor(OLD_CLIPPING), torch.tensor(ADV), torch.tensor(WEIGHTS), config
    ).loss.backward()
    assert logp.grad[0] != 0


def test_trained_positions_only_gives_the_full_logits_gradient() -> None:
    """The output layer at the trained positions only (`logits_to_keep`) gives the same per-token
    logprobs and LoRA gradients as computing every position's logits, on a packed micro-batch whose rows
    train different spans; a row of padding alone keeps one position."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from art_ray.models.local import resolve_base_model
    from art_ray.trainer.loss import token_logprobs, trained_positions

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model("tiny"), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero, so the adapter's gradients depend on the whole graph
            torch.nn.init.normal_(param, std=0.02)
    rows, length = 3, 24
    input_ids = torch.randint(0, 100, (rows, length))
    targets = torch.randint(0, 100, (rows, length))
    weights = torch.zeros(rows, length)
    weights[0, 5:12], weights[1, 9:20], weights[2, 14:16] = 1.0, 0.5, 2.0
    advantages = torch.randn(rows, length)

    def loss_and_grads(keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        if keep is None:
            logprobs = token_logprobs(model(input_ids=input_ids).logits, targets)
            w, a = weights, advantages
        else:
            logits = model(input_ids=input_ids, logits_to_keep=keep).logits
            logprobs = token_logprobs(logits, targets[:, keep])
            w, a = weights[:, keep], advantages[:, keep]
        loss = -(logprobs * a * w).sum()
        loss.backward()
        trained = (logprobs * (w > 0)).detach()
        grads = [p.grad.clone() for n, p in model.named_parameters() if p.requires_grad]
        return loss.detach(), trained[w > 0], grads

    keep = trained_positions(weights)
    assert keep.tolist() == list(range(5, 20))
    full_loss, full_logprobs, full_grads = loss_and_grads(None)
    kept_loss, kept_logprobs, kept_grads = loss_and_grads(keep)
    torch.testing.assert_close(kept_loss, full_loss)
    torch.testing.assert_close(kept_logprobs, full_logprobs)
    assert any(g.abs().sum() > 0 for g in full_grads)
    for kept, full in zip(kept_grads, full_grads, strict=True):
        torch.testing.assert_close(kept, full)
    assert trained_positions(torch.zeros(2, 8)).tolist() == [0]


def test_truncated_importance_sampling_weighs_by_the_sampler_when_old_logprobs_are_precalculated() -> None:
    """precalculate_logprobs (ART): the ratio is against the trainer's old policy, and the truncated weight
    is exp(old - sampler), capped, as ART's loss; a sampler logprob missing (NaN) weighs 1."""
    config = TrainConfig(policy_loss="cispo", truncated_importance_sampling=1.5)
    old = torch.tensor(LOGP)  # the trainer's policy before the update: every ratio is 1
    sampler = torch.tensor([-0.5, -3.0, math.nan, -0.2, 0.0])
    result = policy_loss(
        torch.tensor(LOGP), old, torch.tensor(ADV), torch.tensor(WEIGHTS), config, sampler_logprobs=sampler
    )
    weights = [
        min(math.exp(lp - s), 1.5) if not math.isnan(s) else 1.0
        for lp, s in zip(LOGP, sampler.tolist(), strict=True)
    ]
    expected = sum(-w * a * lp * tw for w, a, lp, tw in zip(weights, ADV, LOGP, WEIGHTS, strict=True))
    assert result.policy_loss.item() == pytest.approx(expected, rel=1e-5)
    assert result.clip_fraction.item() == 0
