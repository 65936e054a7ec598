"""Batch building with exact sampled ids, drift handling, and packing that keeps sequences apart."""

import math

import pytest
import torch
from factories import served_choice
from transformers import AutoModelForCausalLM, AutoTokenizer

from art_ray import History, Trajectory, TrajectoryGroup
from art_ray.models import TINY, prepare
from art_ray.trainer.batches import TokenizeStats, TokenSequence, history_sequences, tokenize_groups
from art_ray.trainer.loss import token_logprobs
from art_ray.trainer.packing import MIN_STEP_PREFIX, pack_sequences, pack_step, segment_attention_mask
from art_ray.trainer.step_prefix import StepPrefix

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"a": 40, "b": 2}'},
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare(TINY))


def render(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def tool_trajectory(tokenizer, drift: bool = False) -> tuple[Trajectory, dict]:
    context = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 40 + 2?"}]
    prompt1 = render(tokenizer, context)
    sampled1 = tokenizer.encode('<tool_call>{"name": "add"}</tool_call><|im_end|>', add_special_tokens=False)
    tool_turn = tokenizer.encode(
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    prompt2 = prompt1 + sampled1 + tool_turn
    if drift:  # the server re-rendered turn 1 differently from what was sampled
        prompt2 = prompt1 + sampled1[:-2] + tool_turn
    sampled2 = tokenizer.encode("The answer is 42.<|im_end|>", add_special_tokens=False)
    logprobs1 = tuple(-0.1 * (i + 1) for i in range(len(sampled1)))
    logprobs2 = tuple(-0.05 * (i + 1) for i in range(len(sampled2)))
    trajectory = Trajectory(
        messages_and_choices=[
            *context,
            served_choice("", tuple(sampled1), logprobs1, tuple(prompt1), tool_calls=[TOOL_CALL]),
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            served_choice("The answer is 42.", tuple(sampled2), logprobs2, tuple(prompt2)),
        ],
        reward=1.0,
    )
    parts = {
        "prompt1": prompt1,
        "sampled1": sampled1,
        "tool_turn": tool_turn,
        "sampled2": sampled2,
        "logprobs1": logprobs1,
        "logprobs2": logprobs2,
    }
    return trajectory, parts


def test_multi_turn_tool_trajectory_keeps_exact_sampled_ids_and_masks_only_assistant_tokens(
    tokenizer,
) -> None:
    trajectory, p = tool_trajectory(tokenizer)
    stats = TokenizeStats()
    [sequence] = history_sequences(trajectory.messages_and_choices, None, tokenizer, stats)
    assert sequence.input_ids == p["prompt1"] + p["sampled1"] + p["tool_turn"] + p["sampled2"]
    expected_mask = (
        [False] * len(p["prompt1"])
        + [True] * len(p["sampled1"])
        + [False] * len(p["tool_turn"])
        + [True] * len(p["sampled2"])
    )
    assert sequence.trainable == expected_mask
    trained = [lp for lp, t in zip(sequence.logprobs, sequence.trainable, strict=True) if t]
    assert trained == pytest.approx([*p["logprobs1"], *p["logprobs2"]])
    assert all(math.isnan(lp) for lp, t in zip(sequence.logprobs, sequence.trainable, strict=True) if not t)
    assert stats.tokenization_drift == 0


def test_drift_in_a_rerendered_turn_keeps_one_sequence_with_the_sampled_ids(tokenizer) -> None:
    """As the email agent's calls drift: the server re-serialized the sampled call's JSON (other spacing,
    another split), and ART's splice keeps the conversation one sequence: turn 1's sampled ids, then
    turn 2's prompt from the end of its re-rendered turn 1 on."""
    trajectory, p = tool_trajectory(tokenizer)
    rerendered = tokenizer.encode(
        '<tool_call>\n{"name":"add"}\n</tool_call><|im_end|>', add_special_tokens=False
    )
    assert rerendered != p["sampled1"]
    trajectory.messages_and_choices[-1].prompt_token_ids = p["prompt1"] + rerendered + p["tool_turn"]
    stats = TokenizeStats()
    [sequence] = history_sequences(trajectory.messages_and_choices, None, tokenizer, stats)
    assert sequence.input_ids == p["prompt1"] + p["sampled1"] + p["tool_turn"] + p["sampled2"]
    trained = [lp for lp, t in zip(sequence.logprobs, sequence.trainable, strict=True) if t]
    assert trained == pytest.approx([*p["logprobs1"], *p["logprobs2"]])
    assert (stats.tokenization_drift, stats.tokenization_drift_cuts) == (1, 0)


def test_a_third_turn_after_a_spliced_one_extends_the_same_sequence(tokenizer) -> None:
    trajectory, p = tool_trajectory(tokenizer)
    rerendered = tokenizer.encode(
        '<tool_call>{"name":  "add"}</tool_call><|im_end|>', add_special_tokens=False
    )
    prompt2 = p["prompt1"] + rerendered + p["tool_turn"]
    trajectory.messages_and_choices[-1].prompt_token_ids = prompt2
    user_turn = tokenizer.encode("\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    sampled3 = tokenizer.encode("Welcome!<|im_end|>", add_special_tokens=False)
    third = served_choice("Welcome!", tuple(sampled3), (-0.2,) * len(sampled3))
    third.prompt_token_ids = prompt2 + p["sampled2"] + user_turn  # turn 2 re-rendered as it was sampled
    trajectory.messages_and_choices += [{"role": "user", "content": "Thanks"}, third]
    stats = TokenizeStats()
    [sequence] = history_sequences(trajectory.messages_and_choices, None, tokenizer, stats)
    spliced = p["prompt1"] + p["sampled1"] + p["tool_turn"] + p["sampled2"]
    assert sequence.input_ids == spliced + user_turn + sampled3
    assert sequence.num_trainable == len(p["sampled1"]) + len(p["sampled2"]) + len(sampled3)
    assert (stats.tokenization_drift, stats.tokenization_drift_cuts) == (1, 0)


def test_drift_whose_rerendered_turn_cannot_be_found_starts_a_new_sequence(tokenizer) -> None:
    # the re-rendered turn 1 lost its end-of-turn token: a role marker comes first, so no splice
    trajectory, p = tool_trajectory(tokenizer, drift=True)
    stats = TokenizeStats()
    first, second = history_sequences(trajectory.messages_and_choices, None, tokenizer, stats)
    assert (stats.tokenization_drift, stats.tokenization_drift_cuts) == (1, 1)
    assert first.input_ids == p["prompt1"] + p["sampled1"]
    assert second.input_ids == p["prompt1"] + p["sampled1"][:-2] + p["tool_turn"] + p["sampled2"]
    assert second.num_trainable == len(p["sampled2"])


def test_drift_after_a_cut_off_turn_starts_a_new_sequence(tokenizer) -> None:
    # turn 1 hit max_tokens: it has no end-of-turn token, so where its re-rendering ends is unknown
    trajectory, p = tool_trajectory(tokenizer)
    first = trajectory.messages_and_choices[2]
    cut_off = p["sampled1"][:-1]
    trajectory.messages_and_choices[2] = served_choice(
        "",
        tuple(cut_off),
        p["logprobs1"][:-1],
        tuple(p["prompt1"]),
        tool_calls=first.message.model_dump()["tool_calls"],
    )
    rerendered = tokenizer.encode(
        '<tool_call>\n{"name":"add"}\n</tool_call><|im_end|>', add_special_tokens=False
    )
    trajectory.messages_and_choices[-1].prompt_token_ids = p["prompt1"] + rerendered + p["tool_turn"]
    stats = TokenizeStats()
    sequences = history_sequences(trajectory.messages_and_choices, None, tokenizer, stats)
    assert len(sequences) == 2 and (stats.tokenization_drift, stats.tokenization_drift_cuts) == (1, 1)


def test_choice_without_prompt_ids_uses_the_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    choice = served_choice("Hello", (19556, 2), (-0.3, -0.2), prompt_token_ids=None)
    [sequence] = history_sequences([*messages, choice], None, tokenizer, TokenizeStats())
    assert sequence.input_ids == render(tokenizer, messages) + [19556, 2]


def test_groups_weights_advantages_and_zero_variance(tokenizer) -> None:
    short, _ = tool_trajectory(tokenizer)
    long = short.model_copy(deep=True)
    long.messages_and_choices.append({"role": "user", "content": "again"})
    short.reward, long.reward = 0.0, 1.0
    history = Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, served_choice()], reward=1.0)
    extra = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "y"},
            served_choice(token_ids=(5, 6, 7), logprobs=(-1, -1, -1)),
        ],
        additional_histories=[History(messages_and_choices=history.messages_and_choices)],
        reward=0.5,
    )
    flat = TrajectoryGroup([history, history.model_copy(deep=True)])  # all rewards equal
    sequences, stats = tokenize_groups([TrajectoryGroup([short, long, extra]), flat], tokenizer)
    assert stats.num_groups == 2 and stats.num_groups_trainable == 1
    # extra has advantage 0 (it is the group mean) and drops out; its histories would share its weight
    assert stats.num_trajectories == 2
    per_trajectory: dict[int, float] = {}
    for sequence in sequences:
        per_trajectory[sequence.trajectory_id] = per_trajectory.get(sequence.trajectory_id, 0) + (
            sequence.weight * sequence.num_trainable
        )
    assert sorted(per_trajectory.values()) == pytest.approx([0.5, 0.5])  # the batch sums to 1
    assert sorted(s.advantage for s in sequences) == pytest.approx([-1.2247, 1.2247], abs=1e-3)


def test_additional_histories_share_the_trajectory_weight(tokenizer) -> None:
    main = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "a"},
            served_choice(token_ids=(5, 6), logprobs=(-1, -1)),
        ],
        additional_histories=[
            {
                "messages_and_choices": [
                    {"role": "user", "content": "b"},
                    served_choice(token_ids=(7,), logprobs=(-1,)),
                ]
            }
        ],
        reward=1.0,
    )
    other = Trajectory(messages_and_choices=[{"role": "user", "content": "c"}, served_choice()], reward=0.0)
    sequences, _ = tokenize_groups([TrajectoryGroup([main, other])], tokenizer)
    mains = [s for s in sequences if s.advantage > 0]
    assert len(mains) == 2
    assert sum(s.weight * s.num_trainable for s in mains) == pytest.approx(0.5)


@pytest.fixture(scope="module")
def tiny_model():
    return AutoModelForCausalLM.from_pretrained(
        prepare(TINY), dtype=torch.float32, attn_implementation="sdpa"
    )


def labelled(sequences: list[TokenSequence]) -> list[TokenSequence]:
    """Sequence k gets weight k + 1, which traces its tokens through the packing."""
    for index, sequence in enumerate(sequences):
        sequence.weight, sequence.advantage = float(index + 1), 1.0
    return sequences


def assert_packed_equals_unpacked(
    model, sequences: list[TokenSequence], rows, prefix: list[int] = ()
) -> None:
    """Every trained token's logprob in the packed rows (after the step's `prefix`, computed apart) equals
    its logprob in its own unpacked forward pass."""
    packed: dict[int, list[torch.Tensor]] = {index: [] for index in range(len(sequences))}
    step_prefix = StepPrefix(model, list(prefix), trains=False) if prefix else None
    with torch.no_grad():
        for row in rows:
            logits = model(
                input_ids=torch.tensor([row.input_ids]),
                position_ids=torch.tensor([row.position_ids]),
                attention_mask=segment_attention_mask(
                    torch.tensor([row.segment_ids]), torch.tensor([row.parent_ids]), len(prefix)
                ),
                past_key_values=step_prefix.cache(1) if step_prefix else None,
            ).logits
            values = token_logprobs(logits, torch.tensor([row.target_ids]))[0]
            for position, weight in enumerate(row.weights):
                if weight > 0:
                    packed[int(weight) - 1].append(values[position])
        for index, sequence in enumerate(sequences):
            ids = torch.tensor([sequence.input_ids])
            alone = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
            expected = alone[torch.tensor(sequence.trainable[1:])]
            assert len(packed[index]) == len(expected) == sequence.num_trainable
            torch.testing.assert_close(torch.stack(packed[index]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("share_prefixes", [True, False])
def test_packing_keeps_sequences_separate(tokenizer, tiny_model, share_prefixes) -> None:
    trajectory, _ = tool_trajectory(tokenizer)
    drifted, _ = tool_trajectory(tokenizer, drift=True)
    stats = TokenizeStats()
    sequences = history_sequences(trajectory.messages_and_choices, None, tokenizer, stats)
    sequences += history_sequences(drifted.messages_and_choices, None, tokenizer, stats)
    total = sum(len(s.input_ids) for s in labelled(sequences))
    rows = pack_sequences(sequences, total + 5, share_prefixes=share_prefixes)
    assert len(rows) == 1 and len(rows[0].input_ids) == total + 5
    if share_prefixes:  # the two conversations start alike: their common context is stored once
        assert rows[0].segment_ids.count(0) > 5
    else:
        assert rows[0].segment_ids[-6:] == [len(sequences), 0, 0, 0, 0, 0]
    assert_packed_equals_unpacked(tiny_model, sequences, rows)


def sampled(prompt: list[int], completion: list[int], group_id: int) -> TokenSequence:
    sequence = TokenSequence(group_id=group_id)
    sequence.extend(prompt)
    sequence.extend(completion, [-1.0] * len(completion))
    return sequence


def test_a_groups_samples_share_their_prompt(tiny_model) -> None:
    prompt = list(range(5, 25))
    group = [sampled(prompt, [30 + i, 40 + i, 50], 0) for i in range(4)]
    other = [sampled([7, *prompt[1:]], [60, 61], 1), sampled([7, *prompt[1:]], [62], 1)]
    [row] = pack_sequences(labelled([*group, *other]), 128)
    # group 0: 19 prompt tokens once, then each sample's last prompt token and its 3 tokens
    # group 1: shares only what both of its samples have (all but the last prompt token)
    assert 128 - row.segment_ids.count(0) == (19 + 4 * 4) + (19 + 3 + 2)
    first_sample = row.segment_ids.index(2)
    assert row.position_ids[first_sample : first_sample + 4] == [19, 20, 21, 22]
    assert row.parent_ids[first_sample] == 1
    assert_packed_equals_unpacked(tiny_model, [*group, *other], [row])


def test_a_group_too_long_for_one_row_continues_in_another() -> None:
    prompt = list(range(5, 25))
    group = labelled([sampled(prompt, [30 + i, 40 + i], 0) for i in range(6)])
    rows = pack_sequences(group, 19 + 3 * 3)  # the prefix and three continuations per row
    assert len(rows) == 2
    assert [sum(w > 0 for w in row.weights) for row in rows] == [6, 6]


def test_a_steps_common_prefix_is_cut_from_its_rows_and_computed_once(tiny_model) -> None:
    system = list(range(5, 5 + MIN_STEP_PREFIX + 8))  # a system prompt every conversation starts with
    groups = [[sampled([*system, 100 + g, 101], [30 + i, 40 + g, 50], g) for i in range(3)] for g in range(3)]
    sequences = labelled([sequence for group in groups for sequence in group])
    step = pack_step(sequences, 80)
    # the prefix stops where the groups part; one row holds every group: its first question token once,
    # then each sample's last context token and its 3 sampled tokens
    assert step.prefix == system
    assert len(step.rows) == 1 and step.rows[0].position_ids[0] == len(system)
    assert 80 - step.rows[0].segment_ids.count(0) == 3 * (1 + 3 * 4)
    assert_packed_equals_unpacked(tiny_model, sequences, step.rows, step.prefix)
    # with the prefix in the rows, each group takes a row of its own and computes the prefix there
    assert len(pack_sequences(sequences, 80)) == 3


def test_a_short_common_start_stays_in_the_rows() -> None:
    sequences = labelled([sampled([5, 6, 7, 100 + g], [30 + g, 31], g) for g in range(2)])
    step = pack_step(sequences, 64)
    assert step.prefix == [] and step.rows[0].position_ids[0] == 0


def test_sequence_longer_than_a_row_is_an_error(tokenizer) -> None:
    trajectory, _ = tool_trajectory(tokenizer)
    sequences = history_sequences(trajectory.messages_and_choices, None, tokenizer, TokenizeStats())
    with pytest.raises(ValueError, match="raise the trainer's sequence_length"):
        pack_sequences(sequences, 8)
