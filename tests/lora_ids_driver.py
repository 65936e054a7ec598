"""A step published again under its name while a request of the old weights runs, for tests/test_lora_ids.py.

One engine (the tiny model, 2 adapter slots) behind the replica's AdapterStore, no Ray: `n@1` serves; a
long request R1 samples on it; `n@1` is loaded again from another folder (a new adapter id under the same
name, as when a restarted trainer publishes a step again); another model's adapter is loaded (it takes the
new id's slot: R1's old id was made active again, and is newer); R2 asks for `n@1` (the new id) while R1
runs. Then the engine must still answer. Prints one JSON line: what each request got, and whether the
engine lived.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import torch

from art_ray.adapters.lora_files import initial_adapter, write_peft_adapter
from art_ray.adapters.spec import LoRASpec
from art_ray.models.local import TINY, prepare
from art_ray.serving.adapter_store import AdapterStore
from art_ray.serving.config import ServingConfig
from art_ray.serving.engine_config import EngineConfig
from art_ray.serving.vllm_app import build_engine_and_app

SPEC = LoRASpec(r=8, alpha=16)


def adapter(base_model: str, folder: Path, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(tensor.shape, generator=generator) if ".lora_B." in name else tensor
        for name, tensor in initial_adapter(base_model, SPEC).items()
    }
    return write_peft_adapter(folder, tensors, SPEC, base_model)


async def sample(engine, serving_models, name: str, request_id: str, max_tokens: int, started=None):  # noqa: ANN001, ANN201
    from vllm import SamplingParams

    lora = serving_models.lora_requests[name]  # what vLLM's server resolves a request's model to
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    final = None
    async for output in engine.generate("Tell me a story.", params, request_id, lora_request=lora):
        if started is not None and not started.is_set():
            started.set()
        final = output
    return {"lora_int_id": lora.lora_int_id, "tokens": len(final.outputs[0].token_ids)}


async def main(root: Path) -> dict:
    from vllm.v1.engine.exceptions import EngineDeadError

    base_model = str(prepare(TINY))
    config = ServingConfig(
        engine=EngineConfig(model=base_model, device="cpu", max_model_len=512, threads=1, max_loras=2),
        keep_versions=2,
    )
    engine, app = await build_engine_and_app(config)

    async def nowhere(model: str, step: int) -> None:
        return None

    serving_models = app.state.openai_serving_models
    store = AdapterStore(serving_models, engine, root / "served", 2, base_model, nowhere)
    await store.load_folder("n", 1, adapter(base_model, root / "n1-old", 1))
    started = asyncio.Event()
    first = asyncio.ensure_future(sample(engine, serving_models, "n@1", "R1", 300, started))
    await started.wait()
    await store.load_folder("n", 1, adapter(base_model, root / "n1-new", 2))  # the same step, new weights
    await asyncio.sleep(0.5)  # R1 samples on: its old id is made active again
    await store.load_folder("x", 1, adapter(base_model, root / "x1", 3))
    result: dict = {"R1_running_when_R2_came": not first.done()}
    try:
        second = await sample(engine, serving_models, "n@1", "R2", 8)
        result |= {"R2": second, "R1": await first}
        result["after"] = await sample(engine, serving_models, "n@1", "R3", 4)
        result["engine_alive"] = True
    except EngineDeadError as error:
        result["engine_alive"] = False
        result["error"] = repr(error)[:300]
    engine.shutdown()
    return result


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="art-lora-ids-") as folder:
        print(json.dumps(asyncio.run(main(Path(folder)))), flush=True)
    sys.exit(0)
