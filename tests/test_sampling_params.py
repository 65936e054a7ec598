"""Sampling parameters travel with each choice into the trainer's rows (pure logic, no engine)."""

from __future__ import annotations

import warnings

import pytest
from factories import served_choice
from transformers import AutoTokenizer

from art_ray import SamplingParams, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, sampled_tokens
from art_ray.models import TINY, prepare
from art_ray.trainer.batches import tokenize_groups
from art_ray.trainer.packing import pack_step

PROMPT = (1, 2, 3, 4)


def test_a_requests_parameters_are_read_with_the_engines_defaults() -> None:
    assert SamplingParams.of_request({}) == SamplingParams(temperature=1.0)
    assert SamplingParams.of_request(
        {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 3, "max_completion_tokens": 7}
    ) == SamplingParams(temperature=0.5, top_p=0.9, top_k=20, seed=3, max_tokens=7)
    assert SamplingParams.of_request({"temperature": "hot"}) is None  # the engine answers it with a 400
    assert SamplingParams.of_request({"temperature": -1}) is None
    assert SamplingParams(temperature=0.0).training_temperature == 1.0  # greedy: vLLM's logprobs at 1
    assert not SamplingParams(top_p=1.0, top_k=-1).truncates
    assert SamplingParams(top_p=0.9).truncates and SamplingParams(top_k=5).truncates


def choice(temperature: float | None, token_ids: tuple[int, ...]):  # noqa: ANN201
    params = None if temperature is None else {"temperature": temperature, "max_tokens": 8}
    return served_choice(
        token_ids=token_ids,
        logprobs=tuple(-0.5 for _ in token_ids),
        prompt_token_ids=PROMPT,
        sampling_params=params,
    )


def test_a_mixed_group_trains_each_token_at_its_own_temperature() -> None:
    temperatures = [0.5, 0.5, 1.0, None]
    completions = [(11, 12), (13, 14, 15), (16,), (17, 18)]
    group = TrajectoryGroup(
        Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice(t, ids)], reward=r)
        for t, ids, r in zip(temperatures, completions, [1.0, 0.0, 0.5, 0.25], strict=True)
    )
    assert [sampled_tokens(t.messages_and_choices[-1]).temperature for t in group] == [0.5, 0.5, 1.0, 1.0]
    sequences, stats = tokenize_groups([group], AutoTokenizer.from_pretrained(prepare(TINY)))
    assert stats.choices_without_sampling_params == 1
    [row] = pack_step(sequences, row_length=32).rows
    # each trained target carries its own token's temperature; context and padding are at 1
    by_token = {
        target: temperature
        for target, temperature, weight in zip(row.target_ids, row.temperatures, row.weights, strict=True)
        if weight > 0
    }
    assert by_token == {11: 0.5, 12: 0.5, 13: 0.5, 14: 0.5, 15: 0.5, 16: 1.0, 17: 1.0, 18: 1.0}
    assert all(t == 1.0 for t, w in zip(row.temperatures, row.weights, strict=True) if w == 0)


def test_a_train_temperature_trains_every_token_at_it() -> None:
    """TrainConfig.train_temperature: every trained token at that temperature, whatever it was sampled
    at (ART's way at 1.0); the engine's logprobs are at the sampled one, so the trainer's must be used."""
    group = TrajectoryGroup(
        Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice(t, ids)], reward=r)
        for t, ids, r in zip([0.5, 0.7], [(11, 12), (13,)], [1.0, 0.0], strict=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(prepare(TINY))
    sequences, _ = tokenize_groups([group], tokenizer, train_temperature=1.0)
    [row] = pack_step(sequences, row_length=32).rows
    assert {t for t, w in zip(row.temperatures, row.weights, strict=True) if w > 0} == {1.0}
    with pytest.raises(ValueError, match="needs precalculate_logprobs"):
        TrainConfig(train_temperature=1.0)
    assert TrainConfig(train_temperature=1.0, precalculate_logprobs=True).train_temperature == 1.0


def test_choices_without_sampling_params_are_told_once_per_run() -> None:
    model = TrainableModel(name="legacy", project="p", base_model="b")
    groups = [
        TrajectoryGroup(
            Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice(None, (5,))], reward=r)
            for r in (0.0, 1.0)
        )
    ]
    with pytest.warns(UserWarning, match="2 choice\\(s\\) carry no sampling_params"):
        model._check_train_groups(groups, TrainConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model._check_train_groups(groups, TrainConfig())
    recorded = TrainableModel(name="recorded", project="p", base_model="b")
    tempered = [
        TrajectoryGroup(
            Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice(0.7, (5,))], reward=r)
            for r in (0.0, 1.0)
        )
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recorded._check_train_groups(tempered, TrainConfig())
