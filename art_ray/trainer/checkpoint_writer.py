"""DeepSpeed's checkpoint engine with the file writes off the training thread.

`engine.save_checkpoint` hands each file's state to its checkpoint engine's `save`. This one takes a
snapshot (tensors cloned, containers copied: the training thread may change the originals as soon as
`save` returns) and a single writer thread `torch.save`s it, in order, with any other work the checkpoint
needs (the PEFT adapter folder, an upload). So a rank's `save_checkpoint` costs the copy, and the next
train call runs while the files are written. `wait` blocks until everything queued so far is on disk, and
raises the first error a write met. The format is DeepSpeed's: `load_checkpoint` reads it as ever.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def snapshot(value: Any) -> Any:
    """A copy of `value` the caller may keep while the original changes: tensors copied to host memory
    (a GPU rank's snapshot does not hold device memory while it waits for the writer; loading maps
    tensors to the parameters' devices anyway), dicts, lists and tuples rebuilt; anything else (configs,
    numbers, strings) is shared, as training does not change it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = copy.copy(value)  # keeps the dict's type (OrderedDict, defaultdict)
        for key, item in value.items():
            copied[key] = snapshot(item)
        return copied
    if isinstance(value, list):
        return [snapshot(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(snapshot(item) for item in value)
    return value


class BackgroundCheckpointEngine(TorchCheckpointEngine):
    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def save(self, state_dict: Any, path: str) -> None:
        state = snapshot(state_dict)
        zipfile = self.zipfile_serialization
        self.submit(lambda: torch.save(state, path, _use_new_zipfile_serialization=zipfile))

    def submit(self, work: Callable[[], None]) -> None:
        """Run `work` on the writer thread after everything queued before it."""
        with self._lock:
            self._pending.append(self._writer.submit(work))

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
