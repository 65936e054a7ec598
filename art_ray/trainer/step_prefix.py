"""A step's shared prefix (art_ray/trainer/packing.py `pack_step`), computed once for all of its rows.

Its forward runs once an optimizer step; every micro-batch reads its keys and values through a fresh
cache. To train through it, each micro-batch reads leaf copies of them; after its backward the leaves'
gradients are added up, and one backward at the end of the step sends the sum through the prefix's own
forward. The rows cost their own tokens only, and the gradient equals the one of rows that each held the
prefix.
"""

from __future__ import annotations

from typing import Any

import torch


class StepPrefix:
    """The keys and values of `prefix_ids` under `engine` (PEFT model behind DeepSpeed) as it is now."""

    def __init__(self, engine: Any, prefix_ids: list[int], trains: bool) -> None:
        device = engine.device
        ids = torch.tensor([prefix_ids], dtype=torch.long, device=device)
        positions = torch.arange(len(prefix_ids), device=device).unsqueeze(0)
        with torch.set_grad_enabled(trains):
            output = engine(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.length = len(prefix_ids)
        self.trains = trains
        self.key_values = [(layer.keys, layer.values) for layer in output.past_key_values.layers]
        self._leaves: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] | None = None

    def cache(self, rows: int) -> Any:
        """A new cache holding the prefix for each of `rows` rows (the model appends the rows' own keys
        and values to it)."""
        from transformers import DynamicCache

        pairs = self.key_values
        if self.trains:
            self._leaves = [tensor.detach().requires_grad_() for pair in pairs for tensor in pair]
            pairs = list(zip(self._leaves[0::2], self._leaves[1::2], strict=True))
        return DynamicCache(
            ddp_cache_data=[
                (keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)) for keys, values in pairs
            ]
        )

    def gather(self) -> None:
        """After a micro-batch's backward: add the gradient its rows sent into the prefix (in float32: a
        bf16 sum over a step's rows would round away small ones)."""
        grads = [
            leaf.grad.float() if leaf.grad is not None else torch.zeros(leaf.shape, device=leaf.device)
            for leaf in self._leaves
        ]
        self._grads = (
            grads if self._grads is None else [a + b for a, b in zip(self._grads, grads, strict=True)]
        )
        self._leaves = []

    def backward(self, engine: Any) -> None:
        """The gathered gradient through the prefix's forward, inside the optimizer step: DeepSpeed reduces
        it over ranks with the rows' own at step(). engine.backward scales this as it scaled the rows'
        losses, which the gathered gradient already carries: the trainer runs fp32 or bf16 (no fp16 loss
        scaling, engine.deepspeed_config), where that scale is 1."""
        if self._grads is None:
            return
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        tensors = [tensor for pair in self.key_values for tensor in pair]
        surrogate = sum(
            (tensor.float() * grad).sum() for tensor, grad in zip(tensors, self._grads, strict=True)
        )
        # A ZeRO optimizer takes a backward that follows another with no forward between as a later phase
        # of the same backward (reentrant checkpointing): ZeRO-3 then copies this one's gradient
        # partitions over the rows' instead of adding to them (the adapter trained on the prefix's share
        # alone). engine.forward opens a new backward with this call; the prefix's forward ran before
        # the rows', so it is made here.
        if isinstance(engine.optimizer, ZeROOptimizer):
            engine.optimizer.clear_backward_seen_flag()
        engine.backward(surrogate, scale_wrt_gas=False)
        self._grads = None
