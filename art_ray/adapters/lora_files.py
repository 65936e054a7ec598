"""LoRA adapters as tensors and as PEFT folders: what the trainer publishes and what vLLM loads."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pydantic
import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# A model name is one path segment: it names folders on replicas, so nothing that could escape one.
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidModelNameError(ValueError):
    pass


def validate_model_name(name: str) -> str:
    if not isinstance(name, str) or not MODEL_NAME_PATTERN.match(name) or ".." in name:
        raise InvalidModelNameError(
            f"invalid model name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def versioned_name(name: str, step: int) -> str:
    """ART's form of one LoRA version: `name@step`."""
    return f"{name}@{step}"


def parse_versioned_name(model: str) -> tuple[str, int | None]:
    """`name@7` -> ("name", 7); `name` -> ("name", None). Raises InvalidModelNameError."""
    name, separator, step = model.partition("@")
    validate_model_name(name)
    if not separator:
        return name, None
    if not step.isdigit():
        raise InvalidModelNameError(f"invalid step in {model!r}: expected name@<non-negative integer>")
    return name, int(step)


class LoRASpec(pydantic.BaseModel):
    """Shape of the adapter every version of a model shares."""

    model_config = pydantic.ConfigDict(extra="forbid")

    r: int = pydantic.Field(default=16, ge=1)
    alpha: int = pydantic.Field(default=32, ge=1)
    dropout: float = pydantic.Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = pydantic.Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )

    def peft_config(self, base_model: str):  # type: ignore[no-untyped-def]
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model,
        )


def adapter_shapes(base_model: str, spec: LoRASpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the adapter's tensors (PEFT state-dict keys), without loading weights."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        peft_model = get_peft_model(model, spec.peft_config(base_model))
    return {name: tuple(tensor.shape) for name, tensor in get_peft_model_state_dict(peft_model).items()}


def initial_adapter(base_model: str, spec: LoRASpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Step 0: random A, zero B (PEFT's init), so the adapter changes nothing yet can be trained."""
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
    names = tuple(sorted(tensors))
    flat = torch.cat([tensors[name].detach().float().reshape(-1).cpu() for name in names]).numpy()
    return PackedAdapter(names, tuple(tuple(tensors[name].shape) for name in names), flat)


def unpack_adapter(packed: PackedAdapter) -> dict[str, torch.Tensor]:
    # a copy: the array Ray hands back is a read-only view of the object store
    flat = torch.from_numpy(np.array(packed.flat, copy=True))
    tensors, offset = {}, 0
    for name, shape in zip(packed.names, packed.shapes, strict=True):
        size = math.prod(shape)
        tensors[name] = flat[offset : offset + size].view(shape)
        offset += size
    return tensors
