"""Token sequences -> packed rows: several sequences per row, attention kept inside each, and the
prompt a group's samples share stored and computed once.

A row holds units. A unit is a shared prefix (context tokens every member starts with) followed by its
members' continuations: each continuation attends causally to itself and to its prefix, never to a
sibling, and its positions continue from the prefix. So every token sees exactly the tokens it saw in
its own unpacked sequence, and the forward pass of a group's 8 samples of one 44-token prompt computes
that prompt once instead of 8 times. The prefix stops one token short of the first sampled token: the
last context token is the one that predicts it, so each continuation keeps its own copy.

A step shares more than its groups do: every conversation of an agent starts with the same system
prompt and tool schemas (507 of the email agent's ~760 tokens), and a group too long for one row repeats
its prefix in every row it spans. `pack_step` cuts the context all of a step's sequences start with out
of the rows: the trainer computes it once a step and every row attends to its keys and values, with
positions continuing after it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from art_ray.trainer.batches import TokenSequence


@dataclass
class PackedRow:
    """Packed units; `segment_ids` names each token's sequence (0 = padding) and `parent_ids` the prefix
    segment it also attends to (0 = none)."""

    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    segment_ids: list[int] = field(default_factory=list)
    parent_ids: list[int] = field(default_factory=list)
    # Targets are shifted: index t holds the data for predicting input_ids[t + 1].
    target_ids: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    # the temperature the target was sampled at: every logprob of it is computed at that temperature
    temperatures: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    # the sampler's logprobs when old_logprobs are the trainer's (precalculate_logprobs), else empty
    sampler_logprobs: list[float] = field(default_factory=list)

    @classmethod
    def padding(cls, length: int) -> PackedRow:
        row = cls()
        row._pad(length)
        return row

    def with_policy_logprobs(self, policy: list[float] | None) -> PackedRow:
        """This row with the trainer's old logprobs (`policy`, per position; None: the current policy's,
        NaN, ratio 1) and the sampler's kept as sampler_logprobs."""
        old = list(policy) if policy is not None else [math.nan] * len(self.old_logprobs)
        return dataclasses.replace(self, old_logprobs=old, sampler_logprobs=self.old_logprobs)

    def _pad(self, length: int) -> None:
        for name, value in (
            ("input_ids", 0),
            ("position_ids", 0),
            ("segment_ids", 0),
            ("parent_ids", 0),
            ("target_ids", 0),
            ("old_logprobs", 0.0),
            ("temperatures", 1.0),
            ("advantages", 0.0),
            ("weights", 0.0),
        ):
            getattr(self, name).extend([value] * length)


@dataclass
class _Unit:
    prefix: list[int]
    members: list[TokenSequence]

    @property
    def length(self) -> int:
        return len(self.prefix) + sum(len(m.input_ids) - len(self.prefix) for m in self.members)


def _first_trainable(sequence: TokenSequence) -> int:
    return sequence.trainable.index(True)


def _common_prefix(sequences: list[TokenSequence]) -> int:
    first = sequences[0].input_ids
    limit = min(_first_trainable(s) for s in sequences) - 1  # keep the token that predicts a sample
    length = 0
    while length < limit and all(s.input_ids[length] == first[length] for s in sequences[1:]):
        length += 1
    return length


@dataclass
class PackedStep:
    """One optimizer step's rows and `prefix`, the context every sequence of the step starts with (empty:
    none worth sharing), cut from the rows; the rows' positions continue after it."""

    rows: list[PackedRow]
    prefix: list[int] = field(default_factory=list)


# A shorter common start is not worth a forward of its own (a chat template's first tokens are ~5).
MIN_STEP_PREFIX = 32
# At most this share of a row (memory_plan.py counts it): every row attends to the prefix's keys as well
# as its own, and the prefix's graph lives through the step.
MAX_STEP_PREFIX_SHARE = 0.5


def pack_step(
    sequences: list[TokenSequence],
    row_length: int,
    share_prefixes: bool = True,
    share_step_prefix: bool = True,
) -> PackedStep:
    """`pack_sequences` after cutting the step's common prefix (at least MIN_STEP_PREFIX tokens, at most
    MAX_STEP_PREFIX_SHARE of a row, never a token that predicts a sampled one) from every sequence;
    `row_length` then counts the tokens after it."""
    _check_fits(sequences, row_length)  # whole, as the engine saw them (sequence_length bounds a sequence)
    length = _common_prefix(sequences) if share_step_prefix and len(sequences) > 1 else 0
    length = min(length, int(row_length * MAX_STEP_PREFIX_SHARE))
    if length < MIN_STEP_PREFIX:
        return PackedStep(pack_sequences(sequences, row_length, share_prefixes))
    rest = [
        dataclasses.replace(
            sequence,
            input_ids=sequence.input_ids[length:],
            trainable=sequence.trainable[length:],
            logprobs=sequence.logprobs[length:],
            temperatures=sequence.temperatures[length:],
        )
        for sequence in sequences
    ]
    return PackedStep(
        pack_sequences(rest, row_length, share_prefixes, offset=length), sequences[0].input_ids[:length]
    )


def _check_fits(sequences: list[TokenSequence], row_length: int) -> None:
    for sequence in sequences:
        if len(sequence.input_ids) > row_length:
            raise ValueError(
                f"a sequence of {len(sequence.input_ids)} tokens does not fit sequence_length={row_length}: "
                "raise the trainer's sequence_length"
            )


def _units(sequences: list[TokenSequence], row_length: int, share_prefixes: bool) -> list[_Unit]:
    by_group: dict[int, list[TokenSequence]] = defaultdict(list)
    for sequence in sequences:
        by_group[sequence.group_id if share_prefixes else id(sequence)].append(sequence)
    units: list[_Unit] = []
    for members in by_group.values():
        length = _common_prefix(members) if len(members) > 1 else 0
        prefix = members[0].input_ids[:length]
        unit = _Unit(prefix, [])
        for member in sorted(members, key=lambda s: len(s.input_ids), reverse=True):
            if unit.members and unit.length + len(member.input_ids) - length > row_length:
                units.append(unit)  # a group too long for one row continues in another, prefix copied
                unit = _Unit(prefix, [])
            unit.members.append(member)
        units.append(unit)
    return units


def pack_sequences(
    sequences: list[TokenSequence], row_length: int, share_prefixes: bool = True, offset: int = 0
) -> list[PackedRow]:
    """First-fit-decreasing packing of units; padding only at each row's tail. A sequence longer than a
    row is an error: cutting its context or its sampled tokens would train on something the model never
    saw. `offset`: the sequences continue a prefix of that many tokens (positions start there)."""
    _check_fits(sequences, row_length)
    rows: list[list[_Unit]] = []
    space: list[int] = []
    for unit in sorted(_units(sequences, row_length, share_prefixes), key=lambda u: u.length, reverse=True):
        for index, free in enumerate(space):
            if free >= unit.length:
                rows[index].append(unit)
                space[index] -= unit.length
                break
        else:
            rows.append([unit])
            space.append(row_length - unit.length)
    return [_pack_row(units, row_length, offset) for units in rows]


def _pack_row(units: list[_Unit], row_length: int, offset: int) -> PackedRow:
    row = PackedRow()
    segment = 0
    for unit in units:
        parent = 0
        start = len(unit.prefix)
        if unit.prefix:
            segment += 1
            parent = segment
            row.input_ids.extend(unit.prefix)
            row.position_ids.extend(range(offset, offset + start))
            row.segment_ids.extend([segment] * start)
            row.parent_ids.extend([0] * start)
            # prefix tokens only predict context: nothing to train
            row.target_ids.extend([*unit.prefix[1:], 0])
            row.old_logprobs.extend([0.0] * start)
            row.temperatures.extend([1.0] * start)
            row.advantages.extend([0.0] * start)
            row.weights.extend([0.0] * start)
        for member in unit.members:
            segment += 1
            ids = member.input_ids[start:]
            row.input_ids.extend(ids)
            row.position_ids.extend(range(offset + start, offset + len(member.input_ids)))
            row.segment_ids.extend([segment] * len(ids))
            row.parent_ids.extend([parent] * len(ids))
            # the token at t+1 is predicted at t; the last position of a sequence predicts nothing
            row.target_ids.extend([*ids[1:], 0])
            trainable = [*member.trainable[start + 1 :], False]
            logprobs = [*member.logprobs[start + 1 :], math.nan]
            row.old_logprobs.extend(lp if t else 0.0 for lp, t in zip(logprobs, trainable, strict=True))
            temperatures = [*member.temperatures[start + 1 :], 1.0]
            row.temperatures.extend(tt if t else 1.0 for tt, t in zip(temperatures, trainable, strict=True))
            row.advantages.extend(member.advantage if t else 0.0 for t in trainable)
            row.weights.extend(member.weight if t else 0.0 for t in trainable)
    row._pad(row_length - len(row.input_ids))
    return row


def segment_attention_mask(segment_ids: Any, parent_ids: Any | None = None, step_prefix: int = 0) -> Any:
    """Boolean [batch, 1, L, step_prefix + L] mask: every real token attends to the step's prefix (the
    first `step_prefix` keys, computed apart), then causally within its segment or into its prefix
    segment. Padding attends to itself alone, so no softmax row is empty."""
    import torch

    allowed = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    if parent_ids is not None:
        allowed |= (segment_ids.unsqueeze(-2) == parent_ids.unsqueeze(-1)) & (parent_ids != 0).unsqueeze(-1)
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    allowed &= causal & (segment_ids != 0).unsqueeze(-1)
    allowed |= torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    if step_prefix:
        into_prefix = (segment_ids != 0).unsqueeze(-1).expand(*segment_ids.shape, step_prefix)
        allowed = torch.cat([into_prefix, allowed], dim=-1)
    return allowed.unsqueeze(1)
