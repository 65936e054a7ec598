"""Local base models built from PyPI packages (no hub access): `tiny` and `smollm2-135m`."""

from art_ray.models.cache import MODELS_DIR_ENV, models_dir
from art_ray.models.local import (
    LOCAL_MODELS,
    SMOLLM2,
    TINY,
    default_tool_call_parser,
    prepare,
    resolve_base_model,
)

__all__ = [
    "LOCAL_MODELS",
    "MODELS_DIR_ENV",
    "SMOLLM2",
    "TINY",
    "default_tool_call_parser",
    "models_dir",
    "prepare",
    "resolve_base_model",
]
