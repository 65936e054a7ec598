"""LoRA adapters as tensors and as PEFT folders: what the trainer publishes and what vLLM loads."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from art_ray.adapters.spec import LoRASpec

if TYPE_CHECKING:  # torch loads where tensors are made: the registry and the driver only move packed arrays
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_shapes(base_model: str, spec: LoRASpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the adapter's tensors (PEFT state-dict keys), without loading weights."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        peft_model = get_peft_model(model, spec.peft_config(base_model))
    return {name: tuple(tensor.shape) for name, tensor in get_peft_model_state_dict(peft_model).items()}


def initial_adapter(base_model: str, spec: LoRASpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Step 0: random A, zero B (PEFT's init), so the adapter changes nothing yet can be trained."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(adapter_shapes(base_model, spec).items()):
        if ".lora_B." in name:
            tensors[name] = torch.zeros(shape)
        else:
            bound = 1.0 / math.sqrt(shape[-1])
            tensors[name] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
    return tensors


def write_peft_adapter(
    folder: Path, tensors: dict[str, torch.Tensor], spec: LoRASpec, base_model: str
) -> Path:
    """Write a PEFT adapter folder (safetensors + adapter_config.json) that vLLM and peft load."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / ADAPTER_WEIGHTS))
    config = spec.peft_config(base_model).to_dict()
    config = {key: (sorted(value) if isinstance(value, set) else value) for key, value in config.items()}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=str))
    return folder


def read_peft_adapter(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter folder written by `write_peft_adapter`."""
    from safetensors.torch import load_file

    return load_file(str(folder / ADAPTER_WEIGHTS))


@dataclass(frozen=True)
class PackedAdapter:
    """Adapter tensors as one flat float32 array: Ray serializes a numpy array without pickling it and
    reads it back zero-copy from the object store (a dict of ~100 torch tensors took ~5x longer)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    flat: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)


def pack_adapter(tensors: dict[str, torch.Tensor]) -> PackedAdapter:
    import torch

    names = tuple(sorted(tensors))
    flat = torch.cat([tensors[name].detach().float().reshape(-1).cpu() for name in names]).numpy()
    return PackedAdapter(names, tuple(tuple(tensors[name].shape) for name in names), flat)


def unpack_adapter(packed: PackedAdapter) -> dict[str, torch.Tensor]:
    import torch

    # a copy: the array Ray hands back is a read-only view of the object store
    flat = torch.from_numpy(np.array(packed.flat, copy=True))
    tensors, offset = {}, 0
    for name, shape in zip(packed.names, packed.shapes, strict=True):
        size = math.prod(shape)
        tensors[name] = flat[offset : offset + size].view(shape)
        offset += size
    return tensors
