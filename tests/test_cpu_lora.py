"""The grouped CPU LoRA ops against vLLM's own torch ops (loaded unpatched from vLLM's source file)."""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points

import pytest
import torch

from art_ray.serving import cpu_lora


@pytest.fixture(scope="module")
def vllm_ops():
    from vllm.lora.ops.torch_ops import lora_ops

    spec = importlib.util.spec_from_file_location("vllm_lora_ops_unpatched", lora_ops.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


INDEX_CASES = {
    "one adapter": [2, 2, 2, 2, 2],
    "mixed adapters": [0, 1, 0, 3, 1],
}


@pytest.mark.parametrize("indices", INDEX_CASES.values(), ids=INDEX_CASES.keys())
@pytest.mark.parametrize("four_dims", [False, True])
def test_shrink_matches_vllm(vllm_ops, generator, indices, four_dims):
    inputs = torch.randn(5, 64, generator=generator)
    weights = torch.randn(4, 8, 64, generator=generator)
    if four_dims:
        weights = weights.unsqueeze(1)
    index = torch.tensor(indices)
    expected, actual = torch.zeros(5, 8), torch.zeros(5, 8)
    vllm_ops.bgmv_shrink(inputs, weights, expected, index, 0.5)
    cpu_lora.bgmv_shrink(inputs, weights, actual, index, 0.5)
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("indices", INDEX_CASES.values(), ids=INDEX_CASES.keys())
@pytest.mark.parametrize("add_inputs", [False, True])
def test_expand_and_expand_slice_match_vllm(vllm_ops, generator, indices, add_inputs):
    inputs = torch.randn(5, 8, generator=generator)
    weights = torch.randn(4, 48, 8, generator=generator)
    index = torch.tensor(indices)
    start = torch.randn(5, 50, generator=generator)  # wider than the adapter: model padding
    expected, actual = start.clone(), start.clone()
    vllm_ops.bgmv_expand(inputs, weights, expected, index, add_inputs)
    cpu_lora.bgmv_expand(inputs, weights, actual, index, add_inputs)
    torch.testing.assert_close(actual, expected)
    expected, actual = start.clone(), start.clone()
    vllm_ops.bgmv_expand_slice(inputs, weights[:, :16], expected, index, 16, 16, add_inputs)
    cpu_lora.bgmv_expand_slice(inputs, weights[:, :16], actual, index, 16, 16, add_inputs)
    torch.testing.assert_close(actual, expected)


def test_prefill_ops_use_the_grouped_matmul(vllm_ops, generator):
    """sgmv (prefill) explodes per-sequence indices and calls bgmv through its module globals."""
    inputs = torch.randn(6, 64, generator=generator)
    weights = torch.randn(3, 8, 64, generator=generator)
    lengths, slots = torch.tensor([2, 4]), torch.tensor([1, 2])
    expected = torch.zeros(6, 8)
    vllm_ops.sgmv_shrink(inputs, weights, expected, None, lengths, slots, 2, 4, 6, 1.0)
    cpu_lora.register()
    from vllm.lora.ops.torch_ops import lora_ops

    actual = torch.zeros(6, 8)
    lora_ops.sgmv_shrink(inputs, weights, actual, None, lengths, slots, 2, 4, 6, 1.0)
    torch.testing.assert_close(actual, expected)
    assert lora_ops.bgmv_shrink is cpu_lora.bgmv_shrink


def test_tokens_without_an_adapter_get_no_lora(generator):
    inputs = torch.randn(3, 8, generator=generator)
    weights = torch.randn(2, 16, 8, generator=generator)
    start = torch.randn(3, 16, generator=generator)
    output = start.clone()
    cpu_lora.bgmv_expand(inputs, weights, output, torch.tensor([0, -1, 1]), add_inputs=True)
    torch.testing.assert_close(output[1], start[1])
    torch.testing.assert_close(output[0], start[0] + inputs[0] @ weights[0].T)
    torch.testing.assert_close(output[2], start[2] + inputs[2] @ weights[1].T)


def test_registered_as_a_vllm_plugin():
    names = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert names["art_ray_cpu_lora"] == "art_ray.serving.cpu_lora:register"


def test_the_short_path_adds_every_slice_of_one_slot(generator) -> None:
    """A packed q/k/v layer (slices of different widths) on one slot: the fused shrink/expand adds what
    each slice's own A and B would; a new adapter in the slot replaces the fused matrices."""
    from types import SimpleNamespace

    from art_ray.serving.cpu_lora import FUSED, LOADED_SLOTS, STEP_SLOTS, apply_lora_to_output

    rank, width, sizes, slots = 4, 24, (24, 8, 8), 3
    layer = SimpleNamespace(
        lora_a_stacked=tuple(torch.randn(slots, 1, rank, width, generator=generator) for _ in sizes),
        lora_b_stacked=tuple(torch.randn(slots, 1, size, rank, generator=generator) for size in sizes),
        output_slices=sizes,
        punica_wrapper=SimpleNamespace(**{STEP_SLOTS: [2]}),
        **{LOADED_SLOTS: {2}},
    )
    x, base = torch.randn(5, width, generator=generator), torch.randn(5, sum(sizes), generator=generator)

    def expected() -> torch.Tensor:
        parts = [
            x @ a[2, 0].T @ b[2, 0].T for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True)
        ]
        return base + torch.cat(parts, dim=1)

    def never(*args):  # noqa: ANN002, ANN202
        raise AssertionError("the fallback must not run for one slot")

    assert torch.allclose(apply_lora_to_output(layer, x, base.clone(), never), expected(), atol=1e-5)
    layer.lora_b_stacked[1][2].mul_(3)  # a new adapter loaded into the slot ...
    layer.__dict__[FUSED].pop(2)  # ... drops its fused matrices (set_lora does this)
    assert torch.allclose(apply_lora_to_output(layer, x, base.clone(), never), expected(), atol=1e-5)


def test_the_short_path_gives_each_slots_rows_their_own_adapter(generator) -> None:
    """Several runs' tokens in one step (slots 0 and 2, tokens without an adapter, and a slot whose
    adapter has no weights in this layer): each row gets its own slot's slices, as vLLM's ops would."""
    from types import SimpleNamespace

    from art_ray.serving.cpu_lora import (
        LOADED_SLOTS,
        STEP_ROWS,
        STEP_SLOTS,
        STEP_TOKENS,
        apply_lora_to_output,
        step_slots,
    )

    rank, width, sizes, slots = 4, 24, (24, 8, 8), 4
    indices = torch.tensor([0, 2, -1, 2, 0, 3, 2])
    used, rows = step_slots(indices)  # as the punica wrapper's metadata update records them
    assert used == [-1, 0, 2, 3] and rows is not None and rows[2].tolist() == [1, 3, 6]
    layer = SimpleNamespace(
        lora_a_stacked=tuple(torch.randn(slots, 1, rank, width, generator=generator) for _ in sizes),
        lora_b_stacked=tuple(torch.randn(slots, 1, size, rank, generator=generator) for size in sizes),
        output_slices=sizes,
        punica_wrapper=SimpleNamespace(
            **{
                STEP_SLOTS: used,
                STEP_ROWS: rows,
                STEP_TOKENS: len(indices),
            }
        ),
        **{LOADED_SLOTS: {0, 2}},  # slot 3's adapter has no weights for this layer
    )
    x = torch.randn(len(indices), width, generator=generator)
    base = torch.randn(len(indices), sum(sizes), generator=generator)
    expected = base.clone()
    for row, slot in enumerate(indices.tolist()):
        if slot in (0, 2):
            parts = [
                x[row] @ a[slot, 0].T @ b[slot, 0].T
                for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True)
            ]
            expected[row] += torch.cat(parts)

    def never(*args):  # noqa: ANN002, ANN202
        raise AssertionError("the fallback must not run when the step's rows are known")

    assert torch.allclose(apply_lora_to_output(layer, x, base.clone(), never), expected, atol=1e-5)
