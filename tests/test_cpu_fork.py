"""On CPU, vLLM's engine processes start by fork (art_ray/serving/cpu_fork.py): the rules for when, and
the worker that sets its own threads. (Every engine the integration tests start runs this way.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import types
from multiprocessing.connection import Connection

import pytest
import torch

from art_ray.serving import cpu_fork

METHOD = cpu_fork.METHOD


@pytest.fixture
def spawning(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment vLLM's CPU platform leaves behind in a replica: spawn, in a Ray actor."""
    import setproctitle
    from vllm.utils import system_utils

    monkeypatch.setenv(METHOD, "spawn")
    monkeypatch.delenv("ART_RAY_CPU_FORK", raising=False)
    monkeypatch.setattr(system_utils, "is_in_ray_actor", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(setproctitle, "setproctitle", setproctitle.setproctitle)  # restored after
    # the watch is process-wide and permanent: pytest's own forks are left alone (tested below in a child)
    monkeypatch.setattr(cpu_fork, "end_forked_children_with_this_process", lambda: watched.append(True))
    watched.clear()
    return monkeypatch


watched: list[bool] = []


def test_an_engine_core_outside_ray_forks_its_worker(spawning: pytest.MonkeyPatch) -> None:
    spawning.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    cpu_fork.register()
    assert os.environ[METHOD] == "fork"


def test_the_plugin_leaves_a_replica_to_fork_engine_core(spawning: pytest.MonkeyPatch) -> None:
    spawning.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    cpu_fork.register()
    assert os.environ[METHOD] == "spawn"


def test_a_replica_forks_its_engine_core(spawning: pytest.MonkeyPatch) -> None:
    from vllm.utils import system_utils

    assert cpu_fork.fork_engine_core()
    assert os.environ[METHOD] == "fork"
    system_utils._maybe_force_spawn()  # vLLM's own check, as the engine runs it before it starts a process
    assert os.environ[METHOD] == "fork"
    assert system_utils.get_mp_context().get_start_method() == "fork"
    import setproctitle
    from ray import _raylet

    assert setproctitle.setproctitle is _raylet.setproctitle  # a forked child can name itself VLLM::...
    assert watched  # the engine core stops if the replica is killed outright


def _replica_forking_an_engine_core(pids: Connection) -> None:
    cpu_fork.end_forked_children_with_this_process()
    engine_core = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    engine_core.start()
    pids.send(engine_core.pid)
    time.sleep(60)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_forked_engine_core_stops_when_its_replica_is_killed_outright() -> None:
    """SIGKILL (the OOM killer, `ray stop --force`) gives the replica no chance to end its children."""
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    replica = context.Process(target=_replica_forking_an_engine_core, args=(writer,))
    replica.start()
    engine_core = reader.recv()
    try:
        os.kill(replica.pid, signal.SIGKILL)
        replica.join()
        deadline = time.monotonic() + 5 * cpu_fork.PARENT_POLL_S
        while _running(engine_core):
            assert time.monotonic() < deadline, "the engine core outlived its replica"
            time.sleep(0.1)
    finally:
        if _running(engine_core):
            os.kill(engine_core, signal.SIGKILL)


def test_a_replica_with_openmp_threads_keeps_spawning(spawning: pytest.MonkeyPatch) -> None:
    spawning.setattr(torch, "get_num_threads", lambda: 2)
    assert not cpu_fork.fork_engine_core()
    assert os.environ[METHOD] == "spawn"


def test_it_can_be_turned_off(spawning: pytest.MonkeyPatch) -> None:
    spawning.setenv("ART_RAY_CPU_FORK", "0")
    cpu_fork.register()
    assert not cpu_fork.fork_engine_core()
    assert os.environ[METHOD] == "spawn"


def test_vllm_loads_it_as_a_general_plugin() -> None:
    from importlib.metadata import entry_points

    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins["art_ray_cpu_fork"] == "art_ray.serving.cpu_fork:register"


def test_a_forked_worker_takes_its_threads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its OpenMP runtime was set up in the replica (one thread); the engine's count is in the environment."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from art_ray.serving.cpu_worker import ForkedCPUWorker
    from art_ray.serving.engine_config import CPU_WORKER_CLS, EngineConfig

    seen: list[int] = []
    monkeypatch.setattr(CPUWorker, "init_device", lambda self: seen.append(torch.get_num_threads()))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ForkedCPUWorker.init_device(object.__new__(ForkedCPUWorker))
    finally:
        torch.set_num_threads(before)
    assert seen == [2]
    kwargs = EngineConfig(model="m", device="cpu").vllm_kwargs()
    assert kwargs["worker_cls"] == CPU_WORKER_CLS == "art_ray.serving.cpu_worker.ForkedCPUWorker"
