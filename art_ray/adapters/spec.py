"""The names of served models (`name`, `name@step`) and the shape of a model's LoRA adapter.

On the types floor (pydantic only): the SDK, the configs and the wire protocol use these without torch.
"""

from __future__ import annotations

import re

import pydantic

# A model name is one path segment: it names folders on replicas, so nothing that could escape one.
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class InvalidModelNameError(ValueError):
    pass


def validate_model_name(name: str) -> str:
    if not isinstance(name, str) or not MODEL_NAME_PATTERN.fullmatch(name) or ".." in name:
        raise InvalidModelNameError(
            f"invalid model name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def versioned_name(name: str, step: int) -> str:
    """ART's form of one LoRA version: `name@step`."""
    return f"{name}@{step}"


def parse_versioned_name(model: str) -> tuple[str, int | None]:
    """`name@7` -> ("name", 7); `name` -> ("name", None). Raises InvalidModelNameError (also for a
    value that is not a string: request bodies reach here as parsed JSON)."""
    if not isinstance(model, str):
        raise InvalidModelNameError(f"a model name is a string, not {type(model).__name__}")
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
