"""The Tinker API's verbs on the DeepSpeed trainer (`tiny` model, one rank shared by three runs):
forward_backward's cross_entropy is art-ray's SFT step on the same tokens, and gradients add up across
calls until optim_step."""

from __future__ import annotations

import asyncio
import math

import pytest
from test_trainer import assert_same_adapter, trainer_config
from transformers import AutoTokenizer

from art_ray import SFTConfig, Trajectory
from art_ray.tinker.types import AdamStep, ForwardBackwardCall, LossDatum, TinkerUserError
from art_ray.trainer.batches import sft_sequences
from art_ray.trainer.group import TrainerGroup

pytestmark = pytest.mark.slow

LEARNING_RATE = 1e-2
# Adam's first step is lr * g / (|g| + eps): an eps far above the gradients makes the update ~ lr * g / eps,
# so equal adapters mean equal gradients, not only equal signs
EPS = 1.0

CONVERSATIONS = [
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue, like the sea."},
    ],
    [
        {"role": "user", "content": "Say a number."},
        {"role": "assistant", "content": "Seven."},
    ],
]


def tinker_data(tokenizer, conversations) -> list[LossDatum]:
    """Each conversation as a Tinker datum with SFT's weights: its assistant tokens, every trained token of
    the step weighing the same (1 / the step's trained tokens)."""
    per_trajectory, _ = sft_sequences(
        [Trajectory(messages_and_choices=messages, reward=0.0) for messages in conversations], tokenizer
    )
    sequences = [sequence for own in per_trajectory for sequence in own]
    total = sum(sum(sequence.trainable[1:]) for sequence in sequences)
    return [
        LossDatum(
            tokens=sequence.input_ids[:-1],
            target_tokens=sequence.input_ids[1:],
            weights=[float(trained) / total for trained in sequence.trainable[1:]],
        )
        for sequence in sequences
    ]


def test_cross_entropy_is_the_sft_step_and_gradients_add_up_until_optim_step(inference_app, tmp_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(inference_app.base_model)
    data = tinker_data(tokenizer, CONVERSATIONS)
    step = AdamStep(learning_rate=LEARNING_RATE, beta1=0.9, beta2=0.99, eps=EPS)

    def config(name: str):
        base = trainer_config(inference_app, name, tmp_path / name)
        settings = base.settings.model_copy(update={"adam_epsilon": EPS, "micro_batch_rows": 1})
        return base.model_copy(update={"settings": settings})

    async def run() -> tuple:
        sft = TrainerGroup(config("sft"), publish=False)
        await sft.start()
        combined, split = (
            TrainerGroup(config(name), publish=False, ranks=sft.ranks) for name in ("combined", "split")
        )
        try:
            await asyncio.gather(combined.start(), split.start())
            events = [
                event
                async for event in sft.train_sft(
                    [Trajectory(messages_and_choices=c, reward=0.0) for c in CONVERSATIONS],
                    SFTConfig(learning_rate=LEARNING_RATE, batch_size=2, max_grad_norm=None),
                )
            ]
            sft_loss = events[0].metrics["loss/train"]

            both = await combined.tinker_forward_backward(
                ForwardBackwardCall(data=data, loss_fn="cross_entropy")
            )
            # forward_only: outputs, no gradients
            again = await combined.tinker_forward_backward(
                ForwardBackwardCall(data=data, loss_fn="cross_entropy", forward_only=True)
            )
            await combined.tinker_optim_step(step)
            first = await split.tinker_forward_backward(
                ForwardBackwardCall(data=data[:1], loss_fn="cross_entropy")
            )
            with pytest.raises(TinkerUserError, match="1 values for"):  # refused; nothing waits for the step
                await split.tinker_forward_backward(
                    ForwardBackwardCall(
                        data=[data[1].model_copy(update={"weights": [1.0]})], loss_fn="cross_entropy"
                    )
                )
            await split.tinker_forward_backward(ForwardBackwardCall(data=data[1:], loss_fn="cross_entropy"))
            metrics = await split.tinker_optim_step(step)
            adapters = [await group.adapter_tensors() for group in (sft, combined, split)]
            return sft_loss, both, again, first, metrics, adapters, (combined.step, split.step)
        finally:
            for group in (combined, split, sft):
                group.shutdown()

    sft_loss, both, again, first, metrics, (sft, combined, split), steps = asyncio.run(run())
    assert both.metrics["loss:sum"] == pytest.approx(sft_loss, abs=1e-5)
    assert again.logprobs == both.logprobs  # the call without gradients left the adapter as it was
    for datum, logprobs, losses in zip(data, both.logprobs, both.elementwise_loss, strict=True):
        assert len(logprobs) == len(datum.tokens) and all(lp <= 0 and math.isfinite(lp) for lp in logprobs)
        assert losses == pytest.approx([-w * lp for w, lp in zip(datum.weights, logprobs, strict=True)])
    assert first.logprobs[0] == pytest.approx(both.logprobs[0], abs=1e-6)
    assert metrics["loss:sum"] == pytest.approx(both.metrics["loss:sum"], abs=1e-5)
    assert steps == (1, 1)
    assert any(tensor.abs().sum() > 0 for name, tensor in combined.items() if "lora_B" in name)
    assert_same_adapter(sft, combined, atol=1e-5)
    assert_same_adapter(combined, split, atol=1e-6)
