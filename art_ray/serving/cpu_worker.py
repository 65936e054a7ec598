"""vLLM's CPU worker, able to start by fork (cpu_fork.py): it sets its torch threads from OMP_NUM_THREADS.

vLLM gives a CPU worker its threads through the environment (OMP_NUM_THREADS, set for it by the process
that starts it), which the OpenMP runtime reads once, when it loads. A forked worker's runtime was loaded
by an ancestor: the replica, where Ray set one thread. Setting the count here, before the worker runs
anything parallel, is safe after fork: the replica's runtime ran one thread (cpu_fork.fork_engine_core
forks only then), so there is no OpenMP thread pool to inherit half-made. A spawned worker already has
the count; nothing changes for it.
Selected with vLLM's `worker_cls` (EngineConfig.vllm_kwargs on CPU).
"""

from __future__ import annotations

import os

import torch
from vllm.v1.worker.cpu_worker import CPUWorker


class ForkedCPUWorker(CPUWorker):
    def init_device(self) -> None:
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # vLLM's init_device then forbids it
        super().init_device()
