"""An unloaded version's folder outlives it: a request admitted before the unload can still make the
engine reload the adapter from there (a missing folder kills vLLM's engine core)."""

from __future__ import annotations

from types import SimpleNamespace

import art_ray.serving.adapter_store as adapter_store
from art_ray.adapters.registry import AdapterVersion
from art_ray.adapters.spec import LoRASpec
from art_ray.serving.adapter_store import AdapterStore, LoadedVersion


class FakeServingModels:  # vLLM's OpenAIServingModels, as far as unloading goes
    def __init__(self) -> None:
        self.lora_requests = {"m@1": SimpleNamespace(lora_int_id=1), "m@2": SimpleNamespace(lora_int_id=2)}

    async def unload_lora_adapter(self, request) -> None:
        self.lora_requests.pop(request.lora_name, None)


class FakeEngine:
    async def remove_lora(self, lora_id: int) -> bool:
        return True


async def test_unloaded_folders_stay_for_the_grace_period(tmp_path, monkeypatch) -> None:
    store = AdapterStore(FakeServingModels(), FakeEngine(), tmp_path, 1, "base", source=None)  # type: ignore[arg-type]
    folders = {step: tmp_path / f"m-{step}" for step in (1, 2)}
    for step, folder in folders.items():
        folder.mkdir()
        record = AdapterVersion(model="m", step=step, base_model="base", lora=LoRASpec(), tensors=None)
        store._loaded.setdefault("m", {})[step] = LoadedVersion(folder, record, f"ref{step}")
    now = [1000.0]
    monkeypatch.setattr(adapter_store.time, "monotonic", lambda: now[0])
    await store._unload("m", 1)
    assert folders[1].is_dir()  # unloaded, but a queued request may still load it
    now[0] += adapter_store.RETIRED_FOLDER_GRACE_S + 1
    await store._unload("m", 2)
    assert not folders[1].exists() and folders[2].is_dir()
    checkpoint = tmp_path / "checkpoint"  # a folder loaded as it is (a checkpoint) is never retired
    checkpoint.mkdir()
    store._loaded["m"][3] = LoadedVersion(checkpoint)
    await store._unload("m", 3)
    assert checkpoint.is_dir() and all(folder != checkpoint for _, folder in store._retired)
