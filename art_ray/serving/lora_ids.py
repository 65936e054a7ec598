"""A step's LoRA requests told apart by adapter id, not by name: a vLLM general plugin, on GPU and CPU.

vLLM's `LoRARequest` compares and hashes by name, and its model runners gather the adapters of a step's
requests in a set (v1/worker/gpu_input_batch.py `InputBatch.make_lora_inputs`, the V2 runner's
v1/worker/gpu/lora_utils.py `LoraState.get_activate_loras`), while the step's token mapping uses ids. A
step published again with new weights (a restarted trainer makes its last steps again) is loaded under
its name `model@step` with a new id; requests admitted before the swap carry the old id, later ones the
new id. A step with both kept one request per name, so one of the two ids was never made active, and the
mapping named an adapter slot that did not exist: `KeyError` in punica_wrapper/utils.py
`convert_mapping`, and the engine died (issue 49's 20-minute soak, after a trainer rank was killed).

Here each distinct id of a step is activated; the scheduler already bounds a step's distinct ids by
`max_loras`, so they fit the slots. Registered as the `vllm.general_plugins` entry point
`art_ray_lora_ids`; set ART_RAY_LORA_IDS=0 to keep vLLM's sets.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

PATCHED = "_art_ray_lora_ids"


def by_id(requests: Iterable[Any]) -> list[Any]:
    """One LoRARequest per adapter id (vLLM's set keeps one per name)."""
    return list({request.lora_int_id: request for request in requests if request}.values())


def register() -> None:
    """vLLM calls this in every process that loads its plugins (idempotent). The model runners' modules are
    patched as they are imported: the replica's API server loads the plugins but runs no model, and
    importing them there cost ~1 s of its start (vllm.lora.utils and what it imports)."""
    if os.environ.get("ART_RAY_LORA_IDS", "1") == "0":
        return
    after_import("vllm.v1.worker.gpu_input_batch", patch_input_batch)
    after_import("vllm.v1.worker.gpu.lora_utils", patch_lora_state)


def patch_input_batch(module: ModuleType) -> None:
    batch = module.InputBatch
    if getattr(batch, PATCHED, False):
        return
    make_lora_inputs = batch.make_lora_inputs

    def make_lora_inputs_by_id(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, list[Any]]:
        prompt_mapping, token_mapping, _ = make_lora_inputs(self, *args, **kwargs)
        return prompt_mapping, token_mapping, by_id(self.lora_id_to_lora_request.values())

    batch.make_lora_inputs = make_lora_inputs_by_id
    setattr(batch, PATCHED, True)


def patch_lora_state(module: ModuleType) -> None:
    state = module.LoraState
    if getattr(state, PATCHED, False):
        return

    def activate_by_id(self: Any, req_ids: list[str]) -> list[Any]:
        return by_id(self.lora_requests.get(req_id) for req_id in req_ids)

    state.get_activate_loras = activate_by_id
    setattr(state, PATCHED, True)


def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """`patch(module)` now if `name` is imported, else right after its import."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, PatchAfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, PatchAfterImport(name, patch))


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds `name` with the finders after it, and has its loader run `patch` once the module is executed."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec
