"""One GRPO step on a batch sampled at temperature 0.5: art-ray's loss and gradient equal TRL's.

art-ray's side is its own data path: served choices carrying their sampling parameters -> tokenize_groups
-> pack_step (the group's prompt stored once) -> token_logprobs at each token's temperature -> policy_loss.
TRL's side is GRPOTrainer's own code: its fused LM head at its sampling temperature
(`_get_per_token_logps_and_entropies`) and `_compute_loss` with loss_type="grpo" (each sequence's token
mean, then the batch mean: art-ray's weighting), called on the same tokens, old logprobs and advantages.
The trainer object is made without __init__ (its constructor wants a dataset and reward functions), with
the attributes its loss reads set to the matching settings.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
from factories import served_choice
from transformers import AutoModelForCausalLM, AutoTokenizer

from art_ray import TrainConfig, Trajectory, TrajectoryGroup
from art_ray.models import TINY, prepare
from art_ray.trainer.batches import group_advantages, tokenize_groups
from art_ray.trainer.loss import policy_loss, token_logprobs, trained_positions
from art_ray.trainer.packing import pack_step, segment_attention_mask

TEMPERATURE = 0.5
BETA = 0.04
PROMPT = [1, 31, 52, 77, 90, 12, 45, 2]
COMPLETIONS = [[101, 102, 103, 104, 105], [201, 202, 203], [301, 302, 303, 304], [401, 402]]
REWARDS = [1.0, 0.0, 0.5, 0.2]  # no advantage is 0: art-ray drops such trajectories, TRL does not


@pytest.fixture
def model_and_tokenizer():
    """Fresh per test: TRL's fused head holds the model it patched, so a deep copy would not be used."""
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    path = prepare(TINY)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    # TRL's log-probabilities come from this head; the model's own forward (art-ray's) is unchanged
    add_fused_lm_head(base, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():  # B = 0 would make the adapter's A gradients zero: a weaker comparison
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    return model, AutoTokenizer.from_pretrained(path)


def sampler_logprobs(model, temperature: float) -> list[list[float]]:
    """Each completion's logprobs at `temperature`, nudged so that ratios differ from 1 and some clip."""
    generator = torch.Generator().manual_seed(1)
    result = []
    for completion in COMPLETIONS:
        ids = torch.tensor([PROMPT + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
        exact = token_logprobs(logits, torch.tensor(completion), torch.full((len(completion),), temperature))
        result.append((exact + 0.3 * torch.randn(len(completion), generator=generator)).tolist())
    return result


def art_ray_step(
    model, tokenizer, old: list[list[float]], config: TrainConfig, temperature: float = TEMPERATURE
):
    choices = [
        served_choice(
            text="x",
            token_ids=tuple(completion),
            logprobs=tuple(logprobs),
            prompt_token_ids=tuple(PROMPT),
            sampling_params={"temperature": temperature, "max_tokens": 8, "seed": 3},
        )
        for completion, logprobs in zip(COMPLETIONS, old, strict=True)
    ]
    group = TrajectoryGroup(
        Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=reward)
        for choice, reward in zip(choices, REWARDS, strict=True)
    )
    sequences, stats = tokenize_groups([group], tokenizer)
    assert stats.choices_without_sampling_params == 0
    step = pack_step(sequences, row_length=64)
    [row] = step.rows
    assert not step.prefix and row.segment_ids.count(0) > 0  # one unit: the prompt once, then 4 samples

    def tensor(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor([getattr(row, name)], dtype=dtype)

    keep = trained_positions(tensor("weights"))
    inputs = {
        "input_ids": tensor("input_ids", torch.long),
        "position_ids": tensor("position_ids", torch.long),
        "attention_mask": segment_attention_mask(
            tensor("segment_ids", torch.long), tensor("parent_ids", torch.long)
        ),
    }

    def at(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return tensor(name, dtype)[:, keep]

    targets, temperatures = at("target_ids", torch.long), at("temperatures")
    assert set(temperatures[at("weights") > 0].tolist()) == {temperature}
    with torch.no_grad(), model.disable_adapter():
        reference = token_logprobs(model(**inputs, logits_to_keep=keep).logits, targets, temperatures)
    logits = model(**inputs, logits_to_keep=keep).logits
    logprobs = token_logprobs(logits, targets, temperatures)
    result = policy_loss(logprobs, at("old_logprobs"), at("advantages"), at("weights"), config, reference)
    return result


def trl_step(model, old: list[list[float]], advantages: list[float], config: TrainConfig) -> torch.Tensor:
    from accelerate import Accelerator
    from trl import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    settings = {
        "accelerator": Accelerator(cpu=True),
        "model": model,
        "temperature": TEMPERATURE,
        "loss_type": "grpo",
        "beta": config.beta,
        "epsilon_low": config.epsilon,
        "epsilon_high": config.clip_high,
        "importance_sampling_level": "token",
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "use_vllm": False,
        "aux_loss_enabled": False,
        "_entropy_bonus_enabled": False,
        "current_gradient_accumulation_steps": 1,
        "args": types.SimpleNamespace(delta=None, use_bias_correction_kl=False),
        "_metrics": {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
    }
    for name, value in settings.items():
        setattr(trainer, name, value)
    width = max(len(c) for c in COMPLETIONS)
    completion_ids = torch.tensor([c + [0] * (width - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in COMPLETIONS])
    inputs = {
        "prompt_ids": torch.tensor([PROMPT] * len(COMPLETIONS)),
        "prompt_mask": torch.ones(len(COMPLETIONS), len(PROMPT), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages),
        "old_per_token_logps": torch.tensor([lp + [0.0] * (width - len(lp)) for lp in old]),
    }
    with torch.no_grad(), model.disable_adapter():
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, width
        )[0]
    return trainer._compute_loss(model, inputs)


def lora_gradients(model) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def test_a_grpo_step_at_temperature_half_equals_trls(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    model.train()
    config = TrainConfig(beta=BETA, epsilon=0.2, epsilon_high=0.28)
    old = sampler_logprobs(model, TEMPERATURE)
    advantages = group_advantages(REWARDS)
    assert advantages is not None and 0.0 not in advantages

    model.zero_grad()
    ours = art_ray_step(model, tokenizer, old, config)
    ours.loss.backward()
    our_gradients = lora_gradients(model)
    model.zero_grad()
    theirs = trl_step(model, old, advantages, config)
    theirs.backward()
    their_gradients = lora_gradients(model)

    assert ours.loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert ours.clip_fraction.item() > 0  # the nudged old logprobs put some tokens outside the clip
    assert max(g.abs().max().item() for g in our_gradients.values()) > 1e-3
    for name, gradient in our_gradients.items():
        torch.testing.assert_close(gradient, their_gradients[name], atol=1e-5, rtol=1e-4, msg=name)


def test_at_the_wrong_temperature_the_loss_differs(model_and_tokenizer) -> None:
    """The comparison can fail: art-ray's step computed at temperature 1 (what it did before its tokens
    carried their temperature) does not equal TRL's at 0.5."""
    model, tokenizer = model_and_tokenizer
    config = TrainConfig(beta=BETA, epsilon=0.2, epsilon_high=0.28)
    old = sampler_logprobs(model, TEMPERATURE)
    advantages = group_advantages(REWARDS)
    with torch.no_grad():
        theirs = trl_step(model, old, advantages, config).item()
        ours = art_ray_step(model, tokenizer, old, config, temperature=1.0).loss.item()
    assert abs(ours - theirs) > 1e-3
