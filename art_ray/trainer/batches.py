"""Trajectory groups -> token sequences -> packed rows: what one GRPO step trains on.

Every assistant choice contributes the exact token ids the engine sampled, with their logprobs; the
context in front of it is the prompt the engine saw (the choice's `prompt_token_ids`), or the chat
template's rendering when the server did not return it. Nothing the model wrote is re-tokenized.

Multi-turn drift: the server renders turn k+1's prompt from the text of turn k, and that re-rendering
may not reproduce turn k's sampled ids (a tool call's JSON re-serialized, whitespace, another split of
the same text). As ART does, the conversation stays one sequence: turn k keeps its sampled ids and the
context after it is turn k+1's prompt from the end of the re-rendered message (its end-of-turn token)
on, so a three-turn agent costs one forward over its conversation, not three over ever longer prompts.
Where that end cannot be found for sure (turn k was cut off before its end-of-turn token, or the
prompts differ before turn k), the sequence is cut and turn k+1 starts a new one on exactly the prompt
it was sampled from. Both are counted: `data/tokenization_drift` and `data/tokenization_drift_cuts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from art_ray.trajectories import Trajectory, TrajectoryGroup, sampled_tokens

STD_EPS = 1e-6


def group_advantages(
    rewards: list[float], scale: bool = True, baseline: float | None = None
) -> list[float] | None:
    """(r - mean) / (std + eps), or only centred; None for a group with no reward variance. With a
    `baseline` (TrajectoryGroup.baseline): r - baseline, never scaled (a running mean comes with no
    std of this group), None when every reward equals it. Plain Python: the driver's trainer group
    imports this module, and torch stays on the ranks."""
    if baseline is not None:
        centred = [reward - baseline for reward in rewards]
        return centred if any(abs(value) >= STD_EPS for value in centred) else None
    if len(rewards) < 2:
        return None
    mean = math.fsum(rewards) / len(rewards)
    centred = [reward - mean for reward in rewards]
    std = math.sqrt(math.fsum(value * value for value in centred) / len(rewards))
    if std < STD_EPS:
        return None
    return [value / (std + STD_EPS) for value in centred] if scale else centred


@dataclass
class TokenSequence:
    """One causal sequence: context tokens (not trained) and sampled tokens (trained)."""

    input_ids: list[int] = field(default_factory=list)
    trainable: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # NaN on context tokens
    # the temperature each token was sampled at (1.0 on context): its logprobs are computed at it
    temperatures: list[float] = field(default_factory=list)
    advantage: float = 0.0
    weight: float = 0.0  # per trainable token
    trajectory_id: int = 0
    group_id: int = 0

    def extend(self, ids: list[int], logprobs: list[float] | None = None, temperature: float = 1.0) -> None:
        self.input_ids.extend(ids)
        self.trainable.extend([logprobs is not None] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [math.nan] * len(ids))
        self.temperatures.extend([temperature] * len(ids))

    @property
    def num_trainable(self) -> int:
        return sum(self.trainable)


@dataclass
class TokenizeStats:
    num_groups: int = 0
    num_groups_trainable: int = 0
    num_trajectories: int = 0
    tokenization_drift: int = 0
    tokenization_drift_cuts: int = 0
    trainable_tokens: int = 0
    # choices trained at temperature 1 because they carry no sampling parameters (older versions', built
    # by hand, ART's), and choices sampled from a truncated distribution (top_p, top_k) the trainer does
    # not reproduce
    choices_without_sampling_params: int = 0
    choices_truncated: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "data/step_num_groups": float(self.num_groups),
            "data/step_num_groups_trainable": float(self.num_groups_trainable),
            "data/step_num_trajectories": float(self.num_trajectories),
            "data/tokenization_drift": float(self.tokenization_drift),
            "data/tokenization_drift_cuts": float(self.tokenization_drift_cuts),
            "data/step_trainable_tokens": float(self.trainable_tokens),
            "data/choices_without_sampling_params": float(self.choices_without_sampling_params),
            "data/choices_truncated": float(self.choices_truncated),
        }


def _render_text(tokenizer: Any, messages: list[dict], tools: list[dict] | None, prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=False)


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> list[int]:
    return tokenizer.encode(_render_text(tokenizer, messages, tools, True), add_special_tokens=False)


def _assistant_message_ids(
    tokenizer: Any, messages: list[dict], index: int, tools: list[dict] | None
) -> list[int]:
    """The tokens of a plain assistant message (no sampled ids): what the chat template writes for it
    after the generation prompt, up to its end-of-turn token (the newline a template puts after that is
    never sampled)."""
    prompt = _render_text(tokenizer, messages[:index], tools, True)
    full = _render_text(tokenizer, messages[: index + 1], tools, False)
    if not full.startswith(prompt):
        raise ValueError(
            f"message {index}: the chat template renders the conversation up to this assistant message "
            "differently from its generation prompt, so its tokens cannot be told apart"
        )
    return tokenizer.encode(full[len(prompt) :].rstrip("\n"), add_special_tokens=False)


def history_sequences(
    messages_and_choices: list,
    tools: list[dict] | None,
    tokenizer: Any,
    stats: TokenizeStats,
    *,
    plain_assistant: bool = False,
    sampled_logprobs: bool = True,
    train_temperature: float | None = None,
) -> list[TokenSequence]:
    """The sequences of one conversation (one, unless multi-turn drift forces a cut: see the module's
    docstring). Trained: each choice's sampled tokens, and with `plain_assistant` the assistant messages
    given as dicts too. Without `sampled_logprobs` every trained token counts as sampled by the current
    policy (NaN old logprob: ratio 1), as in SFT."""
    from openai.types.chat.chat_completion import Choice

    from art_ray.trajectories import get_messages

    messages = get_messages(messages_and_choices)
    special = set(tokenizer.all_special_ids)
    sequences: list[TokenSequence] = []
    current = TokenSequence()
    # what the engine had seen after the last turn (its prompt, then its sampled ids), and the
    # end-of-turn token that turn ended with (None: it was cut off, or has role markers inside)
    previous_prompt: list[int] = []
    seen: list[int] = []
    turn_end_token: int | None = None
    for index, item in enumerate(messages_and_choices):
        temperature = 1.0
        if isinstance(item, Choice):
            tokens = sampled_tokens(item)
            prompt = tokens.prompt_token_ids or _render(tokenizer, messages[:index], tools)
            token_ids, logprobs = tokens.token_ids, tokens.logprobs
            if sampled_logprobs:  # SFT trains the tokens as data, at temperature 1
                temperature = tokens.temperature if train_temperature is None else train_temperature
                if tokens.sampling_params is None:
                    stats.choices_without_sampling_params += 1
                elif tokens.sampling_params.truncates:
                    stats.choices_truncated += 1
        elif plain_assistant and item.get("role") == "assistant":
            prompt = _render(tokenizer, messages[:index], tools)
            token_ids = _assistant_message_ids(tokenizer, messages, index, tools)
            logprobs = [math.nan] * len(token_ids)
        else:
            continue
        if not sampled_logprobs:
            logprobs = [math.nan] * len(token_ids)
        if prompt[: len(seen)] == seen:
            current.extend(prompt[len(seen) :])
        else:
            stats.tokenization_drift += 1
            resume = _after_rerendered_turn(prompt, previous_prompt, turn_end_token, special)
            if resume is None:
                stats.tokenization_drift_cuts += 1
                sequences.append(current)
                current = TokenSequence()
                current.extend(prompt)
            else:
                current.extend(prompt[resume:])
        current.extend(token_ids, logprobs, temperature)
        previous_prompt, seen = prompt, [*prompt, *token_ids]
        ends_turn = bool(token_ids) and token_ids[-1] in special
        turn_end_token = token_ids[-1] if ends_turn and not special.intersection(token_ids[:-1]) else None
    sequences.append(current)
    return [sequence for sequence in sequences if sequence.num_trainable]


def _after_rerendered_turn(
    prompt: list[int], previous_prompt: list[int], turn_end_token: int | None, special: set[int]
) -> int | None:
    """Where, in a drifted prompt, the context after the re-rendered previous turn starts: after the first
    end-of-turn token past the previous prompt, with no other special token (a role marker) before it.
    None where that cannot be told for sure."""
    start = len(previous_prompt)
    if turn_end_token is None or prompt[:start] != previous_prompt:
        return None
    for position in range(start, len(prompt)):
        if prompt[position] == turn_end_token:
            return position + 1
        if prompt[position] in special:
            return None
    return None


def tokenize_groups(
    groups: list[TrajectoryGroup],
    tokenizer: Any,
    scale_rewards: bool = True,
    plain_assistant: bool = False,
    train_temperature: float | None = None,
) -> tuple[list[TokenSequence], TokenizeStats]:
    """Sequences of every trainable group, each token weighted so that every trajectory counts the same;
    each trained token at the temperature it was sampled at, or at `train_temperature`."""
    stats = TokenizeStats(num_groups=len(groups))
    trajectories: list[tuple[Trajectory, float, int]] = []
    for group_id, group in enumerate(groups):
        advantages = group_advantages(group.rewards, scale=scale_rewards, baseline=group.baseline)
        if advantages is None:
            continue
        stats.num_groups_trainable += 1
        trajectories.extend(
            (trajectory, advantage, group_id)
            for trajectory, advantage in zip(group.trajectories, advantages, strict=True)
            if advantage != 0.0
        )
    sequences: list[TokenSequence] = []
    for trajectory_id, (trajectory, advantage, group_id) in enumerate(trajectories):
        own: list[TokenSequence] = []
        for history in trajectory.histories():
            own.extend(
                history_sequences(
                    history.messages_and_choices,
                    history.tools,
                    tokenizer,
                    stats,
                    plain_assistant=plain_assistant,
                    train_temperature=train_temperature,
                )
            )
        tokens = sum(sequence.num_trainable for sequence in own)
        for sequence in own:
            sequence.advantage = advantage
            sequence.trajectory_id = trajectory_id
            sequence.group_id = group_id
            sequence.weight = 1.0 / (tokens * len(trajectories))
        sequences.extend(own)
        stats.num_trajectories += 1 if own else 0
        stats.trainable_tokens += tokens
    return sequences, stats


def sft_sequences(
    trajectories: list[Trajectory], tokenizer: Any
) -> tuple[list[list[TokenSequence]], TokenizeStats]:
    """Each trajectory's sequences for supervised training: every assistant turn (a served choice's
    sampled ids, or a plain message's template tokens) with advantage 1 and weight 1 per token."""
    stats = TokenizeStats(num_trajectories=len(trajectories))
    per_trajectory: list[list[TokenSequence]] = []
    for trajectory_id, trajectory in enumerate(trajectories):
        own: list[TokenSequence] = []
        for history in trajectory.histories():
            own.extend(
                history_sequences(
                    history.messages_and_choices,
                    history.tools,
                    tokenizer,
                    stats,
                    plain_assistant=True,
                    sampled_logprobs=False,
                )
            )
        for sequence in own:
            sequence.advantage, sequence.weight, sequence.trajectory_id = 1.0, 1.0, trajectory_id
        stats.trainable_tokens += sum(sequence.num_trainable for sequence in own)
        per_trajectory.append(own)
    return per_trajectory, stats
