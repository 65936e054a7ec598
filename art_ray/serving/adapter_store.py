"""The LoRA versions one replica serves: load from the object store, name `model@step`, evict old ones."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_ray.adapters.lora_files import (
    PackedAdapter,
    pack_adapter,
    read_peft_adapter,
    unpack_adapter,
    write_peft_adapter,
)
from art_ray.adapters.registry import AdapterVersion
from art_ray.adapters.spec import versioned_name

logger = logging.getLogger(__name__)


# A request admitted before its version was unloaded can still be scheduled; the engine then reloads the
# adapter from its folder, and a missing folder kills the engine. Folders outlive their version this long.
RETIRED_FOLDER_GRACE_S = 600.0


class AdapterLoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class LoadedVersion:
    """One served version: its adapter folder on this node, and, for a version fetched from the registry,
    the registry's record of it (tensors dropped: what a restarted registry takes back from here) and its
    object's id (a republished step has a new one); a checkpoint folder loaded as it is has neither."""

    folder: Path
    record: AdapterVersion | None = None
    object_id: str | None = None


class AdapterStore:
    """`source(model, step)`: where a version this replica lacks is fetched from (the registry), or None."""

    def __init__(
        self,
        serving_models: Any,
        engine: Any,
        folder: Path,
        keep_versions: int,
        base_model: str,
        source: Callable[[str, int], Awaitable[AdapterVersion | None]],
        pinned: Callable[[str], set[int]] = lambda model: set(),
    ) -> None:
        self._serving_models = serving_models  # vLLM's OpenAIServingModels: names -> LoRARequest
        self._engine = engine
        self._folder = folder
        self._keep_versions = keep_versions
        self._base_model = base_model
        self._source = source
        self._pinned = pinned  # steps kept past keep_versions: a release's arms (art_ray/releases.py)
        self._loaded: dict[str, dict[int, LoadedVersion]] = {}  # model -> step -> what serves it
        self._lock = asyncio.Lock()
        # (unloaded at, folder) of versions no longer served, deleted after a grace period
        self._retired: deque[tuple[float, Path]] = deque()

    def latest_step(self, model: str) -> int | None:
        steps = self._loaded.get(model)
        return max(steps) if steps else None

    def served_models(self) -> dict[str, list[int]]:
        return {model: sorted(steps) for model, steps in self._loaded.items() if steps}

    def serves_base(self, version: AdapterVersion) -> bool:
        # The registry is cluster-wide; apps on other base models ignore versions that are not theirs.
        return version.base_model == self._base_model

    async def ensure(self, model: str, step: int) -> bool:
        """Whether `model@step` is served here, fetching it first if this replica lacks it (a version
        published while the replica started, or evicted and asked for again)."""
        if step in self._loaded.get(model, {}):
            return True
        version = await self._source(model, step)
        if version is None or not self.serves_base(version):
            return False
        await self.load(version)
        return True

    async def load(self, version: AdapterVersion) -> bool:
        """Serve `version` (idempotent); returns False if it was already loaded."""
        ref_id = version.tensors.hex()
        async with self._lock:
            loaded = self._loaded.setdefault(version.model, {})
            if version.step in loaded:
                if loaded[version.step].object_id == ref_id:
                    return False
                await self._unload(version.model, version.step)  # same step republished with new weights
            tensors = unpack_adapter(await version.tensors)
            # A fresh folder per version: vLLM keys its prefix cache on (adapter name, path).
            folder = self._folder / version.model / f"{version.step:06d}-{uuid.uuid4().hex[:8]}"
            await asyncio.to_thread(write_peft_adapter, folder, tensors, version.lora, version.base_model)
            await self._add(versioned_name(version.model, version.step), folder)
            record = version.model_copy(update={"tensors": None})
            loaded[version.step] = LoadedVersion(folder, record, ref_id)
            await self._evict(version.model)
            return True

    async def unload_model(self, model: str) -> bool:
        """Stop serving every version of `model` (a deleted run); whether any was served."""
        async with self._lock:
            steps = sorted(self._loaded.get(model, {}))
            for step in steps:
                await self._unload(model, step)
            self._loaded.pop(model, None)
        return bool(steps)

    async def held_versions(self) -> list[tuple[AdapterVersion, PackedAdapter]]:
        """Every version loaded from the registry, with its tensors read back from this replica's disk."""
        async with self._lock:
            held = [
                (served.record, served.folder)
                for steps in self._loaded.values()
                for served in steps.values()
                if served.record is not None
            ]
        return [
            (version, pack_adapter(await asyncio.to_thread(read_peft_adapter, folder)))
            for version, folder in held
        ]

    async def load_folder(self, model: str, step: int, folder: Path) -> None:
        """Serve a PEFT adapter folder already on this node's disk (a checkpoint) as `model@step`."""
        async with self._lock:
            loaded = self._loaded.setdefault(model, {})
            if step in loaded:
                await self._unload(model, step)
            await self._add(versioned_name(model, step), folder, delete_on_error=False)
            loaded[step] = LoadedVersion(folder)
            await self._evict(model)

    async def _evict(self, model: str) -> None:
        """Past the newest `keep_versions`, every step goes but the pinned ones (under the lock)."""
        pinned = self._pinned(model)
        for old_step in sorted(self._loaded.get(model, {}))[: -self._keep_versions]:
            if old_step not in pinned:
                await self._unload(model, old_step)

    async def _add(self, lora_name: str, folder: Path, delete_on_error: bool = True) -> None:
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        result = await self._serving_models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=str(folder))
        )
        if not isinstance(result, str):  # an ErrorResponse
            if delete_on_error:
                shutil.rmtree(folder, ignore_errors=True)
            raise AdapterLoadError(f"loading {lora_name} failed: {result}")

    async def _unload(self, model: str, step: int) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        lora_name = versioned_name(model, step)
        request = self._serving_models.lora_requests.get(lora_name)
        await self._serving_models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=lora_name))
        if request is not None:
            await self._engine.remove_lora(request.lora_int_id)
        served = self._loaded[model].pop(step)
        if served.record is not None:  # never delete a checkpoint folder we were given
            self._retired.append((time.monotonic(), served.folder))
        while self._retired and time.monotonic() - self._retired[0][0] > RETIRED_FOLDER_GRACE_S:
            shutil.rmtree(self._retired.popleft()[1], ignore_errors=True)
