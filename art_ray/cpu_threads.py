"""OpenMP settings of the CPU processes that compute: a vLLM engine's worker and a trainer rank.

Ray starts its workers at nice 15 (`RAY_worker_niceness`), while the driver, the raylet and Serve's proxy
run at nice 0. Linux balances cores by weighted load, so whenever a nice-0 task runs on one core it moves a
nice-15 process's OpenMP threads onto the other, where they take turns: the thread at a barrier spins
through its slice while the one it waits for cannot run. Measured on the 2-core box with the engine's two
threads unpinned: both on one core 30-60% of the time they were both runnable, and a sampling phase took
10-68 s at 0.9-1.1 cores instead of ~6 s at ~1.9 (about every other engine start). A thread pinned to each
core cannot be stacked.

Only a process that owns every core of its node is pinned (a phase of the colocated layout): a role given a
fixed thread count shares the node with another role, and two pinned roles would bind the same cores.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

# One OpenMP place per core of the process's own CPU mask, the team's threads on consecutive places.
EVERY_CORE_PINNED = {"OMP_PLACES": "cores", "OMP_PROC_BIND": "close"}


def trainer_openmp_env(threads: int | None) -> dict[str, str]:
    """A trainer rank's environment, set before torch loads in its actor. `threads` None: every core of
    the node it lands on, one thread pinned per core (the places come from its own CPU mask there)."""
    if threads is None:
        return dict(EVERY_CORE_PINNED)
    return {"OMP_NUM_THREADS": str(threads)}


def every_core_threads() -> int:
    """A trainer rank's thread count when it owns every core, read in its process once torch loaded:
    the OpenMP places (the cores of the process's mask at start). The main thread's own mask is one core
    by then, so `os.sched_getaffinity` would say 1."""
    libgomp = _torch_libgomp()
    places = ctypes.CDLL(libgomp).omp_get_num_places() if libgomp is not None else 0
    return places or len(os.sched_getaffinity(0))


def engine_openmp_env(threads: int | None, bind: str | None) -> dict[str, str]:
    """A vLLM CPU engine's environment, computed in the replica on its node before the engine starts.

    The engine core process must stay unpinned: the worker inherits its CPU mask, so a core process whose
    OpenMP runtime pinned it to the first core would confine the worker there. vLLM pins the worker alone
    (`VLLM_CPU_OMP_THREADS_BIND`) and, with GNU OpenMP preloaded, one thread per listed CPU
    (GOMP_CPU_AFFINITY), which is vLLM's documented CPU setup. `bind` set: passed to vLLM as it is."""
    cores = sorted(os.sched_getaffinity(0))
    env = {"OMP_NUM_THREADS": str(threads or len(cores))}
    if bind is not None:
        return {**env, "VLLM_CPU_OMP_THREADS_BIND": bind}
    libgomp = _torch_libgomp()
    if threads is not None or libgomp is None:
        return {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), libgomp]))
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "LD_PRELOAD": preload}


def _torch_libgomp() -> str | None:
    """The GNU OpenMP runtime torch loads (found without importing torch), or None (another runtime)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = spec.submodule_search_locations[0]
    found = sorted(glob.glob(f"{folder}/lib/libgomp*.so*") + glob.glob(f"{folder}.libs/libgomp*.so*"))
    return found[0] if found else None
