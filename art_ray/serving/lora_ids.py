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

import os
from collections.abc import Iterable
from typing import Any

PATCHED = "_art_ray_lora_ids"


def by_id(requests: Iterable[Any]) -> list[Any]:
    """One LoRARequest per adapter id (vLLM's set keeps one per name)."""
    return list({request.lora_int_id: request for request in requests if request}.values())


def register() -> None:
    """vLLM calls this in every process that builds an engine (idempotent)."""
    if os.environ.get("ART_RAY_LORA_IDS", "1") == "0":
        return
    from vllm.v1.worker import gpu_input_batch
    from vllm.v1.worker.gpu import lora_utils

    batch = gpu_input_batch.InputBatch
    if not getattr(batch, PATCHED, False):
        make_lora_inputs = batch.make_lora_inputs

        def make_lora_inputs_by_id(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, list[Any]]:
            prompt_mapping, token_mapping, _ = make_lora_inputs(self, *args, **kwargs)
            return prompt_mapping, token_mapping, by_id(self.lora_id_to_lora_request.values())

        batch.make_lora_inputs = make_lora_inputs_by_id
        setattr(batch, PATCHED, True)
    state = lora_utils.LoraState
    if not getattr(state, PATCHED, False):

        def activate_by_id(self: Any, req_ids: list[str]) -> list[Any]:
            return by_id(self.lora_requests.get(req_id) for req_id in req_ids)

        state.get_activate_loras = activate_by_id
        setattr(state, PATCHED, True)
