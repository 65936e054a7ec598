"""OpenPipe ART 0.5's own code on art-ray through `art_ray.ARTBackend`, with the real `openpipe-art`
package: the kwarg mapping, the loss against ART's own `loss_fn`, the wire form of ART's trajectories,
and ART scripts (ART's yes-no-maybe example, ART's PipelineTrainer, ART's `train_sft`) on SmolLM2 served
and trained by the session's `smol` backend (each under a model name of its own)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path

import art
import pytest
import torch
from art.loss import loss_fn as art_loss_fn
from art.trajectories import History
from conftest import stop_trainer
from factories import served_choice

from art_ray import LoRASpec, ModelConfig
from art_ray.art_backend import (
    ARTBackend,
    UnsupportedTrainArgumentError,
    group_from_art,
    train_config_from_art,
)
from art_ray.train_config import TrainConfig
from art_ray.trainer.loss import policy_loss
from art_ray.trajectories import is_choice, sampled_tokens

ROOT = Path(__file__).resolve().parents[1]
SMOL_CONFIG = ModelConfig(
    lora=LoRASpec(r=8, alpha=16),
    sequence_length=512,
    max_model_len=1024,
    replica_cpus=0,
    trainer_cpus_per_rank=0,
    share_trainer=True,  # on the session's SmolLM2 trainer (conftest's smollm2_model): no rank of their own
)


# --- the kwarg mapping ------------------------------------------------------------------------------


def test_art_defaults_map_to_cispo_with_arts_clip_range() -> None:
    config, save = train_config_from_art({})
    assert (config.policy_loss, config.epsilon, config.clip_high) == ("cispo", 1.0, 4.0)
    assert config.learning_rate == 5e-6 and config.scale_rewards and save


def test_art_kwargs_map_onto_train_config() -> None:
    config, save = train_config_from_art(
        {
            "learning_rate": 1e-4,
            "loss_fn": "ppo",
            "normalize_advantages": False,
            "kl_penalty_coef": 0.1,
            "importance_sampling_level": "sequence",
            "truncated_importance_sampling": 2.0,
            "packed_sequence_length": 1024,
            "save_checkpoint": False,
            "allow_training_without_logprobs": True,
            "precalculate_logprobs": True,
            "advantage_balance": 0.0,  # an unsupported kwarg at ART's default is harmless
            "verbose": True,
        }
    )
    assert config.policy_loss == "ppo" and (config.epsilon, config.clip_high) == (0.2, 0.2)
    assert not config.scale_rewards  # normalize_advantages=False turns scaling off
    assert (config.kl_penalty_coef, config.importance_sampling_level) == (0.1, "sequence")
    assert (config.truncated_importance_sampling, config.packed_sequence_length) == (2.0, 1024)
    assert config.allow_training_without_logprobs and config.precalculate_logprobs and not save


@pytest.mark.parametrize(
    "kwargs",
    [{"advantage_balance": 0.5}, {"loss_fn": "dro"}, {"importance_sampling_level": "average"}, {"lr": 1e-5}],
)
def test_unsupported_art_kwargs_raise_naming_them(kwargs: dict) -> None:
    with pytest.raises(UnsupportedTrainArgumentError) as raised:
        train_config_from_art(kwargs)
    assert next(iter(kwargs)) in str(raised.value) or str(next(iter(kwargs.values()))) in str(raised.value)


# --- the loss against ART's own -----------------------------------------------------------------------


def _shifted(tensor: torch.Tensor, pad: float) -> torch.Tensor:
    """ART's tensors hold token t's data at t, its loss at t - 1: a column in front lines them up."""
    return torch.cat([torch.full((tensor.shape[0], 1), pad, dtype=tensor.dtype), tensor], dim=1)


@pytest.mark.parametrize("loss", ["cispo", "ppo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("truncated", [None, 1.2])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_loss_equals_arts_loss_fn(loss: str, level: str, truncated: float | None, kl_coef: float) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, length = 2, 7
    logprobs = -torch.rand(rows, length, generator=generator) * 2
    old = logprobs + torch.randn(rows, length, generator=generator) * 0.4
    old[0, 2] = math.nan  # a token trained without logprobs: counts as sampled by the current policy
    reference = logprobs + torch.randn(rows, length, generator=generator) * 0.3
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, length).clone()
    segments = torch.tensor([[0, 1, 1, 1, 2, 2, 0], [3, 3, 3, 4, 4, 4, 4]])  # numbered across rows, as ART's
    weights = torch.where(
        segments > 0, torch.rand(rows, length, generator=generator), torch.zeros(rows, length)
    )
    weights[1, 0] = 0.0  # context inside a segment
    config = TrainConfig(
        policy_loss=loss,
        epsilon=0.2 if loss == "ppo" else 1.0,
        epsilon_high=0.28 if loss == "ppo" else 4.0,
        importance_sampling_level=level,
        truncated_importance_sampling=truncated,
        kl_penalty_coef=kl_coef,
    )
    ours = policy_loss(logprobs, old, advantages, weights, config, reference, segments)

    mask = weights > 0
    inputs = {
        "logprobs": _shifted(torch.where(mask, old, torch.full_like(old, math.nan)), math.nan),
        "advantages": _shifted(advantages, 0.0),
        "assistant_mask": _shifted(mask, False),
        "weights": _shifted(weights, 0.0),
        "group_ids": _shifted(segments, 0),
    }
    experimental = {
        "ppo": loss == "ppo",
        "epsilon": config.epsilon,
        "epsilon_high": config.clip_high,
        "importance_sampling_level": level,
        "kl_penalty_coef": kl_coef,
    }
    if truncated is not None:
        experimental["truncated_importance_sampling"] = truncated
    pad = torch.zeros(rows, 1)
    theirs = art_loss_fn(
        inputs,
        torch.cat([logprobs, pad], dim=1),
        torch.cat([reference, pad], dim=1),
        None,
        experimental,
        reduction="sum",
    )
    assert ours.policy_loss.item() == pytest.approx(theirs.policy_loss_sum.item(), rel=1e-4, abs=1e-6)


# --- ART's trajectories, as they are ---------------------------------------------------------------------


def test_art_groups_cross_with_their_choices_versions_and_exceptions() -> None:
    choice = served_choice("Maybe", token_ids=(7, 8), logprobs=(-0.1, -0.2))
    messages = [{"role": "user", "content": "yes, no or maybe?"}]
    trajectory = art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=0.75,
        metrics={"length": 1},
        metadata={"scenario_id": "s1"},
        initial_policy_version=3,
        final_policy_version=4,
        additional_histories=[History(messages_and_choices=[*messages, choice])],
    )
    trajectory.log("a line")
    group = art.TrajectoryGroup([trajectory, ValueError("rollout failed")], metadata={"split": "train"})
    converted = group_from_art(group)
    [ours] = converted.trajectories
    assert is_choice(ours.messages_and_choices[1])
    assert sampled_tokens(ours.messages_and_choices[1]).token_ids == [7, 8]
    assert (ours.initial_policy_version, ours.final_policy_version) == (3, 4)
    assert (ours.reward, ours.metrics, ours.metadata, ours.logs) == (
        0.75,
        {"length": 1},
        {"scenario_id": "s1"},
        ["a line"],
    )
    assert sampled_tokens(ours.additional_histories[0].messages_and_choices[1]).token_ids == [7, 8]
    assert converted.metadata == {"split": "train"}
    assert ["ValueError" in e.type and e.message == "rollout failed" for e in converted.exceptions] == [True]


# --- ART's scripts on the real stack ------------------------------------------------------------------


def _load_example():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(
        "art_yes_no_maybe", ROOT / "examples/art_yes_no_maybe/train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def art_backend(smollm2_model) -> Iterator[ARTBackend]:
    """ART's protocol over the session's SmolLM2 backend (not closed here: the session owns it). The
    trainers of the models ART registers stop with this module."""
    yield ARTBackend(smollm2_model.backend, model_config=SMOL_CONFIG)
    for name in list(smollm2_model.backend._trainers):
        if name != smollm2_model.model.name:
            stop_trainer(smollm2_model.backend, name)


async def _greedy_logprob(model: art.TrainableModel, step: int, prompt: str) -> float:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        temperature=0.0,
    )
    return sum(entry.logprob for entry in completion.choices[0].logprobs.content)


@pytest.mark.slow
async def test_arts_example_script_trains_logs_and_deletes_checkpoints(art_backend: ARTBackend) -> None:
    example = _load_example()
    args = argparse.Namespace(name="art-ynm", model="smollm2-135m", steps=2, group_size=4, learning_rate=1e-3)
    summary = await example.main(art_backend, args)
    assert summary["steps"] == 2 and len(summary["rewards"]) == 2

    model = art.TrainableModel(name="art-ynm", project="yes-no-maybe", base_model="smollm2-135m")
    await model.register(art_backend)  # a second register of the same model: resumes at its step
    assert await model.get_step() == 2
    assert model.get_inference_name() == "art-ynm@2"
    # the served model changed: the same greedy reply is scored differently by step 0 and step 2
    prompt = example.PROMPTS[0]
    before, after = await _greedy_logprob(model, 0, prompt), await _greedy_logprob(model, 2, prompt)
    assert before != pytest.approx(after, abs=1e-4)
    # ART's model.log wrote its history under the backend's storage; delete_checkpoints kept the latest
    history = Path(model.base_path) / "yes-no-maybe/models/art-ynm/history.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert [row["step"] for row in rows if "train/reward" in row] == [1, 2]
    assert any(key.startswith("loss/") for key in rows[-1])
    assert art_backend.backend.checkpoint_steps(art_backend._twin(model)) == [2]


@pytest.mark.slow
async def test_an_unsupported_kwarg_trains_nothing(art_backend: ARTBackend) -> None:
    example = _load_example()
    model = art.TrainableModel(name="art-ynm", project="yes-no-maybe", base_model="smollm2-135m")
    await model.register(art_backend)
    step = await model.get_step()
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(example.rollout(model, example.PROMPTS[1]) for _ in range(2))], pbar_desc=None
    )
    with pytest.raises(UnsupportedTrainArgumentError, match="kimi_k2_tau"):
        await art_backend.train(model, groups, kimi_k2_tau=0.5)
    assert await model.get_step() == step


@pytest.mark.slow
async def test_arts_pipeline_trainer_runs_on_art_backend(art_backend: ARTBackend) -> None:
    from art.pipeline_trainer import PipelineTrainer

    example = _load_example()
    model = art.TrainableModel(name="art-pipe", project="yes-no-maybe", base_model="smollm2-135m")
    await model.register(art_backend)

    async def rollout_fn(model: art.TrainableModel, scenario: dict, config: None) -> art.TrajectoryGroup:
        group = await art.TrajectoryGroup(example.rollout(model, scenario["prompt"]) for _ in range(4))
        # ART's trainer drops a group whose rewards are all equal and rolls out another: rewards that
        # always differ keep the test's time on its two steps, not on sampling until SmolLM2 disagrees
        for index, trajectory in enumerate(group.trajectories):
            trajectory.reward = float(index % 2)
        return group

    scenarios = ({"prompt": example.PROMPTS[i % 4]} for i in range(10_000))
    trainer = PipelineTrainer(
        model=model,
        backend=art_backend,
        rollout_fn=rollout_fn,
        scenarios=scenarios,
        config=None,
        num_rollout_workers=2,
        min_batch_size=2,
        max_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        eval_at_start=False,
    )
    await trainer.train(handle_signals=False)
    assert await model.get_step() == 2
    history = Path(model.base_path) / "yes-no-maybe/models/art-pipe/history.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    trained = [row for row in rows if "train/reward" in row]
    assert [row["step"] for row in trained] == [1, 2]
    assert all("loss/train" in row for row in trained)


@pytest.mark.slow
async def test_arts_train_sft_is_one_step_through_the_same_trainer(art_backend: ARTBackend) -> None:
    model = art.TrainableModel(name="art-sft", project="yes-no-maybe", base_model="smollm2-135m")
    await model.register(art_backend)
    prompt = "What is the password?"
    conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "Swordfish"}]
    before = await _greedy_logprob(model, 0, prompt)
    await model.train_sft(
        [art.Trajectory(messages_and_choices=conversation) for _ in range(4)],
        art.TrainSFTConfig(learning_rate=1e-3, batch_size=2),
    )
    assert await model.get_step() == 1
    assert await _greedy_logprob(model, 1, prompt) != pytest.approx(before, abs=1e-4)
    history = Path(model.base_path) / "yes-no-maybe/models/art-sft/history.jsonl"
    [row] = [json.loads(line) for line in history.read_text().splitlines()]
    assert row["step"] == 1 and row["data/step_num_gradient_steps"] == 2


@pytest.mark.slow
async def test_an_art_script_trains_on_trajectories_the_endpoint_captured(art_backend: ARTBackend) -> None:
    """ART's model and train call, with trajectories recorded by capture sessions: the agent only gets
    a base URL (here the raw openai client, as any framework would use it)."""
    import openai

    from art_ray import capture_session

    model = art.TrainableModel(name="art-captured", project="yes-no-maybe", base_model="smollm2-135m")
    await model.register(art_backend)

    async def rollout(prompt: str) -> art.Trajectory:
        async with capture_session(model) as session:
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
            completion = await client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": prompt}], max_tokens=6
            )
            reward = float(len(completion.choices[0].message.content or "") % 2)
            return await session.art_trajectory(reward=reward)

    prompt = "Answer yes, no or maybe: is the sky green?"
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(prompt) for _ in range(6)) for _ in range(2)], pbar_desc=None
    )
    assert all(isinstance(t, art.Trajectory) for g in groups for t in g.trajectories)
    before = await _greedy_logprob(model, 0, prompt)
    await art_backend.train(model, groups, learning_rate=1e-3)
    assert await model.get_step() == 1
    assert await _greedy_logprob(model, 1, prompt) != pytest.approx(before, abs=1e-4)


@pytest.mark.slow
async def test_arts_ruler_judges_through_litellm_with_the_served_model(art_backend: ARTBackend) -> None:
    """ART's RULER (LiteLLM's `hosted_vllm/` provider) with the served SmolLM2 as the judge: ART asks for
    structured output, and the endpoint constrains the reply to its JSON schema."""
    from art.rewards import ruler_score_group

    # a judge of its own at step 0 (the initial adapter), so its greedy replies are the same in every run
    model = art.TrainableModel(name="art-judge", project="yes-no-maybe", base_model="smollm2-135m")
    await model.register(art_backend)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    group = art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[*question, {"role": "assistant", "content": text}], reward=0.0)
        for text in ("Paris.", "I like turtles.")
    )
    params = model.litellm_completion_params()
    judged = await ruler_score_group(
        group,
        params["model"],
        extra_litellm_params={
            "api_base": params["base_url"],
            "api_key": params["api_key"],
            "temperature": 0.0,
        },
    )
    assert judged is not None and len(judged.trajectories) == 2
    assert params["model"] == "hosted_vllm/art-judge@0"
    for trajectory in judged.trajectories:
        # (ART's schema leaves the score's range to the rubric: a 135M judge may step outside 0..1)
        assert trajectory.reward == trajectory.metrics["ruler_score"]
        assert trajectory.metrics["independent_reward"] == 0.0
