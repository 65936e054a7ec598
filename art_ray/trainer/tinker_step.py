"""Tinker data on the trainer: a micro-batch of Datums as model inputs (one datum per row, padded at the
tail, with the same attention masks as packed rows), and its per-position logprobs and loss terms.

A `forward_backward` call's gradients are made when its run's `optim_step` comes (art_ray/trainer/worker.py):
the adapter does not move in between, so the replayed forward is the one the call saw, and a trainer shared
by several runs holds no half-accumulated gradients of one run while another trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from art_ray.tinker.types import ForwardBackwardCall, LossDatum, TinkerUserError
from art_ray.trainer.loss import token_logprobs
from art_ray.trainer.packing import segment_attention_mask
from art_ray.trainer.tinker_loss import REQUIRED_INPUTS, check_loss_config, tinker_token_loss

# a rank with fewer micro-batches than another runs this zero-loss one, so every rank takes the same
# collective steps
_PADDING = LossDatum(tokens=[0], target_tokens=[0], weights=[0.0], logprobs=[0.0], advantages=[0.0])


@dataclass(frozen=True)
class LossItem:
    """One datum with the loss it was sent with."""

    datum: LossDatum
    loss_fn: str
    loss_fn_config: dict[str, float]


def check_call(call: ForwardBackwardCall, vocab_size: int, max_tokens: int) -> None:
    """TinkerUserError for a call the trainer cannot compute, before anything runs."""
    check_loss_config(call.loss_fn, call.loss_fn_config)
    if not call.data:
        raise TinkerUserError("forward_backward needs at least one datum")
    for index, datum in enumerate(call.data):
        length = len(datum.tokens)
        if length == 0:
            raise TinkerUserError(f"datum {index}: model_input is empty")
        if length > max_tokens:
            raise TinkerUserError(f"datum {index}: {length} tokens, over this trainer's {max_tokens}")
        for name in ("target_tokens", *REQUIRED_INPUTS[call.loss_fn]):
            values = getattr(datum, name)
            if values is None:
                raise TinkerUserError(
                    f"datum {index}: the {call.loss_fn} loss needs loss_fn_inputs[{name!r}]"
                )
            if len(values) != length:
                raise TinkerUserError(
                    f"datum {index}: loss_fn_inputs[{name!r}] has {len(values)} values for {length} tokens"
                )
        for name in ("tokens", "target_tokens"):
            if any(not 0 <= token < vocab_size for token in getattr(datum, name)):
                raise TinkerUserError(f"datum {index}: {name} outside the vocabulary [0, {vocab_size})")
        for name in ("weights", "logprobs", "advantages"):
            values = getattr(datum, name)
            if values is not None and not all(math.isfinite(value) for value in values):
                raise TinkerUserError(f"datum {index}: loss_fn_inputs[{name!r}] holds a NaN or infinity")


def loss_items(call: ForwardBackwardCall) -> list[LossItem]:
    return [LossItem(datum, call.loss_fn, call.loss_fn_config) for datum in call.data]


def padding_item() -> LossItem:
    return LossItem(_PADDING, "cross_entropy", {})


@dataclass
class ItemOutput:
    logprobs: list[float]
    elementwise_loss: list[float]


def micro_batch_loss(
    module: torch.nn.Module, items: list[LossItem], device: torch.device
) -> tuple[torch.Tensor, list[ItemOutput]]:
    """The micro-batch's summed loss (with the graph, when grad is enabled) and each item's outputs."""
    length = max(len(item.datum.tokens) for item in items)

    def values_of(name: str) -> list:  # type: ignore[type-arg]
        return [getattr(item.datum, name) or [] for item in items]

    def column(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(
            [list(v) + [0] * (length - len(v)) for v in values_of(name)], dtype=dtype, device=device
        )

    segments = torch.tensor(
        [[1] * len(item.datum.tokens) + [0] * (length - len(item.datum.tokens)) for item in items],
        dtype=torch.long,
        device=device,
    )
    position_ids = torch.arange(length, device=device).expand(len(items), length)
    logits = module(
        input_ids=column("tokens", torch.long),
        position_ids=position_ids,
        attention_mask=segment_attention_mask(segments),
    ).logits
    logprobs = token_logprobs(logits, column("target_tokens", torch.long))
    real = segments > 0
    floats = {name: column(name, torch.float32) for name in ("weights", "logprobs", "advantages")}
    terms = []
    for row, item in enumerate(items):
        inputs = {
            name: values[row : row + 1]
            for name, values in floats.items()
            if getattr(item.datum, name) is not None
        }
        term = tinker_token_loss(
            item.loss_fn,
            logprobs[row : row + 1],
            weights=inputs.get("weights"),
            sampler_logprobs=inputs.get("logprobs"),
            advantages=inputs.get("advantages"),
            config=item.loss_fn_config,
        )
        terms.append(torch.where(real[row : row + 1], term, torch.zeros_like(term)))
    per_token = torch.cat(terms)
    outputs = [
        ItemOutput(
            logprobs=logprobs[row, : len(item.datum.tokens)].tolist(),
            elementwise_loss=per_token[row, : len(item.datum.tokens)].tolist(),
        )
        for row, item in enumerate(items)
    ]
    return per_token.sum(), outputs
