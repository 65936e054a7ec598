"""Supervised fine-tuning through art-ray's SDK (`model.train_sft`): cross-entropy on assistant turns, on
the same LoRA, trainer group, step counter, checkpoints and publish as GRPO. SmolLM2 on the session's
`smol` backend, under a model name of its own."""

from __future__ import annotations

import pytest
from conftest import stop_trainer
from factories import served_choice

from art_ray import LoRASpec, ModelConfig, SFTConfig, TrainableModel, Trajectory
from art_ray.trainer.train_batch import sft_batches

pytestmark = pytest.mark.slow

PROMPT = "What is the password?"
REPLY = "Swordfish"


async def greedy(model: TrainableModel, step: int) -> str:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step),
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0.0,
    )
    return completion.choices[0].message.content or ""


async def test_an_sft_step_makes_the_served_model_give_the_trained_reply(smollm2_model) -> None:
    model = TrainableModel(
        name="smol-sft",
        project="tests",
        base_model="smollm2-135m",
        config=ModelConfig(
            lora=LoRASpec(r=8, alpha=16),
            sequence_length=512,
            max_model_len=1024,
            replica_cpus=0,
            trainer_cpus_per_rank=0,
            share_trainer=True,  # SFT on the session run's ranks: no trainer start of its own
        ),
    )
    await model.register(smollm2_model.backend)
    step = await model.get_step()
    assert REPLY not in await greedy(model, step)
    conversation = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": REPLY}]
    new_step = await model.train_sft(
        [Trajectory(messages_and_choices=conversation) for _ in range(8)],
        SFTConfig(learning_rate=2e-3, batch_size=1),
    )
    assert new_step == step + 1 == await model.get_step()
    assert [m["train/gradient_step"] for m in model.last_train_metrics] == list(range(8))
    assert model.last_train_metrics[-1]["loss/train"] < model.last_train_metrics[0]["loss/train"]
    assert (await greedy(model, new_step)).strip() == REPLY
    # the new step is checkpointed and served like a GRPO step's
    assert new_step in smollm2_model.backend.checkpoint_steps(model)
    stop_trainer(smollm2_model.backend, model.name)


def test_sft_batches_train_every_assistant_turn_at_ratio_one() -> None:
    """Served choices train on their sampled ids, plain assistant messages on their template tokens; no
    old logprob is kept (NaN: ratio 1, the loss is the cross-entropy)."""

    class Tokenizer:
        all_special_ids: list[int] = []

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):  # noqa: ANN001, ANN201
            text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
            return text + ("<assistant>" if add_generation_prompt else "")

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    served = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "a"},
            served_choice("xy", token_ids=(120, 121), logprobs=(-1.0, -2.0), prompt_token_ids=None),
        ]
    )
    plain = Trajectory(
        messages_and_choices=[{"role": "user", "content": "b"}, {"role": "assistant", "content": "z"}]
    )
    [shard] = sft_batches([served, plain, plain], Tokenizer(), SFTConfig(batch_size=2), 256, 1)
    assert shard.learning_rates == [5e-5, 5e-5] and len(shard.steps) == 2
    first = shard.steps[0].rows
    trained = [
        (row.target_ids[i], row.old_logprobs[i])
        for row in first
        for i in range(len(row.weights))
        if row.weights[i]
    ]
    # (the packer orders rows by shared prefix, not by trajectory)
    assert sorted(token for token, _ in trained) == sorted([120, 121, *[ord(c) for c in "z</>"]])
    assert all(logprob != logprob for _, logprob in trained)  # NaN
    assert sum(row_weight for row in first for row_weight in row.weights) == pytest.approx(1.0)
