"""Faster LoRA for vLLM's CPU backend: a vLLM general plugin, loaded in every engine process.

vLLM's torch LoRA ops (used on CPU) gather every token's adapter matrix (`weights[indices]`) before an
einsum: per token, per LoRA layer, a copy of the whole A or B matrix. A 32-sequence prefill of 44-token
prompts copies ~50 MB per op. Measured with SmolLM2-135M, r=16, 32 x 16 sampled tokens, one thread:
16 tok/s with an adapter against 81 tok/s without. Here tokens are grouped by adapter slot and each
group is one matmul (one group in the usual case: every request on the latest version).

Tokens without an adapter (index -1) get no LoRA contribution, as on GPU; vLLM's torch ops index the
last slot with -1 and apply that adapter to them.

Above the ops, each LoRA linear layer takes a short path (`apply_lora_to_output`): the slots a step's
tokens use are read once per step (not once per op), a layer whose adapters carry no weights for it (the
MLP of a q/k/v/o adapter: vLLM wraps every linear layer) adds nothing, and when every token uses one slot
the layer's slices are one shrink and one expand-add (`_fused`); when a step's tokens use several slots
(several runs sampling at once), each slot's rows (found once per step) take that path. Profiled on the
demo's rollout (SmolLM2-135M, 32 x 16 tokens, r=16, 2 threads): LoRA took 35% of the engine worker's
time with two matmuls per slice, 17% fused (the base model's matmuls: 34-40%).

Registered as the `vllm.general_plugins` entry point `art_ray_cpu_lora`; set ART_RAY_CPU_LORA=0 to keep
vLLM's own ops.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def lora_matmul(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Row t of the result is inputs[t] @ weights[indices[t]].T (zeros where indices[t] < 0).
    `weights` is [slots, out, in] or [slots, 1, out, in]."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = torch.unique(indices).tolist()
    if len(slots) == 1 and slots[0] >= 0:
        return inputs @ weights[slots[0]].to(dtype).T
    result = inputs.new_zeros((inputs.shape[0], weights.shape[1]))
    for slot in slots:
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        result.index_copy_(0, rows, inputs.index_select(0, rows) @ weights[slot].to(dtype).T)
    return result


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = lora_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # the same row and width handling as vLLM's op: adapter and model may pad differently
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:limit, :width]
    else:
        output_tensor[:, :width] = outputs[:limit, :width]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


LOADED_SLOTS = "_art_ray_loaded_slots"  # on a LoRA layer: the slots whose adapter has weights for it
FUSED = "_art_ray_fused"  # on a LoRA layer: slot -> its slices' A and B as two matrices (see _fused)
STEP_SLOTS = "_art_ray_step_slots"  # on the punica wrapper: the slots this step's tokens use
# on the punica wrapper, when a step's tokens use several slots: each slot's token rows, and the token count
STEP_ROWS = "_art_ray_step_rows"
STEP_TOKENS = "_art_ray_step_tokens"


def step_slots(indices: torch.Tensor) -> tuple[list[int], dict[int, torch.Tensor] | None]:
    """The slots a step's tokens use (-1: no adapter) and, when there are several, each slot's token rows."""
    slots = torch.unique(indices).tolist()
    rows = {slot: (indices == slot).nonzero().squeeze(1) for slot in slots} if len(slots) > 1 else None
    return slots, rows


def apply_lora_to_output(layer: Any, x: torch.Tensor, output: torch.Tensor, fallback: Any) -> torch.Tensor:
    """A LoRA linear layer's adapter contribution, added to `output` (its base output) in place."""
    slots = getattr(layer.punica_wrapper, STEP_SLOTS, None)
    if slots is None:
        return fallback(layer, x, output)
    loaded = getattr(layer, LOADED_SLOTS, set())
    if not any(slot in loaded for slot in slots):  # no adapter in use has weights here (or no adapter)
        return output
    if x.ndim != 2 or output.ndim != 2 or x.dtype != output.dtype:
        return fallback(layer, x, output)
    if len(slots) == 1:
        shrink, expand = _fused(layer, slots[0], x.dtype)
        return output.addmm_(x @ shrink, expand)
    rows = getattr(layer.punica_wrapper, STEP_ROWS, None)
    if rows is None or getattr(layer.punica_wrapper, STEP_TOKENS, None) != x.shape[0]:
        return fallback(layer, x, output)
    # several runs' adapters in one step: each slot's rows through its fused matrices
    for slot, slot_rows in rows.items():
        if slot in loaded:
            shrink, expand = _fused(layer, slot, x.dtype)
            output.index_add_(0, slot_rows, x.index_select(0, slot_rows) @ shrink @ expand)
    return output


def _fused(layer: Any, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's adapter as one shrink [in, slices x r] (every slice's A, stacked) and one expand
    [slices x r, out] (each slice's B on the diagonal block of its output columns), built once per loaded
    adapter: a packed q/k/v layer then costs two matmuls per step instead of two per slice. The zeros
    off the diagonal cost FLOPs a rank-16 adapter does not notice; each call costs ~10-20 us here."""
    cache = layer.__dict__.setdefault(FUSED, {})
    if slot not in cache:
        shrinks = [lora_a[slot, 0].to(dtype) for lora_a in layer.lora_a_stacked]
        rank = sum(a.shape[0] for a in shrinks)
        expand = torch.zeros(rank, sum(layer.output_slices), dtype=dtype)
        row = column = 0
        for a, lora_b, size in zip(shrinks, layer.lora_b_stacked, layer.output_slices, strict=True):
            # vLLM folded the adapter's scaling into B when it loaded it
            expand[row : row + a.shape[0], column : column + size] = lora_b[slot, 0, :size].to(dtype).T
            row, column = row + a.shape[0], column + size
        cache[slot] = (torch.cat(shrinks).T.contiguous(), expand)
    return cache[slot]


def _track_loaded_slots(layer_class: type) -> None:
    set_lora, reset_lora = layer_class.set_lora, layer_class.reset_lora

    def tracked_reset(self: Any, index: int) -> None:
        reset_lora(self, index)
        getattr(self, LOADED_SLOTS, set()).discard(index)
        self.__dict__.get(FUSED, {}).pop(index, None)

    def tracked_set(self: Any, index: int, *args: Any, **kwargs: Any) -> None:
        set_lora(self, index, *args, **kwargs)
        self.__dict__.setdefault(LOADED_SLOTS, set()).add(index)
        self.__dict__.get(FUSED, {}).pop(index, None)

    layer_class.reset_lora, layer_class.set_lora = tracked_reset, tracked_set


def register() -> None:
    """vLLM calls this in every process that builds an engine (idempotent)."""
    if os.environ.get("ART_RAY_CPU_LORA", "1") == "0":
        return
    from vllm.lora.layers import base_linear
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    # the sgmv (prefill) ops call the bgmv ones through lora_ops' globals; punica_cpu imported its own
    for module in (torch_ops, lora_ops, punica_cpu):
        module.bgmv_shrink = bgmv_shrink
        module.bgmv_expand = bgmv_expand
        module.bgmv_expand_slice = bgmv_expand_slice
    wrapper = punica_cpu.PunicaWrapperCPU
    if getattr(wrapper, "_art_ray_patched", False):
        return
    wrapper._art_ray_patched = True
    update_metadata = wrapper.update_metadata

    def update_metadata_and_slots(self: Any, *args: Any, **kwargs: Any) -> None:
        update_metadata(self, *args, **kwargs)
        slots, rows = step_slots(self.token_lora_indices)
        setattr(self, STEP_SLOTS, slots)
        setattr(self, STEP_ROWS, rows)
        setattr(self, STEP_TOKENS, self.token_lora_indices.shape[0])

    wrapper.update_metadata = update_metadata_and_slots
    layer_class = base_linear.BaseLinearLayerWithLoRA
    # every subclass that overrides them (packed q/k/v, merged gate/up) calls the base's inside
    for cls in {layer_class, *_subclasses(layer_class)}:
        if "set_lora" in cls.__dict__ or "reset_lora" in cls.__dict__:
            _track_loaded_slots(cls)
    fallback = layer_class._apply_lora_to_output

    def short_path(self: Any, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return apply_lora_to_output(self, x, output, fallback)

    layer_class._apply_lora_to_output = short_path


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found
