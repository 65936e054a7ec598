"""The plugin that lets a CPU engine core fork its model worker (art_ray/serving/cpu_worker_fork.py):
only outside Ray, only on CPU, and not when turned off. (Every engine the integration tests start runs
with it; bench/memory.py shows the start it saves.)"""

from __future__ import annotations

import sys
import types

import pytest

from art_ray.serving import cpu_worker_fork

METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


@pytest.fixture
def spawned_engine_core(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment an engine core inherits from its replica: spawn, set by vLLM in the Ray actor."""
    monkeypatch.setenv(METHOD, "spawn")
    monkeypatch.delenv("ART_RAY_CPU_WORKER_FORK", raising=False)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    return monkeypatch


def test_an_engine_core_outside_ray_forks_its_worker(spawned_engine_core: pytest.MonkeyPatch) -> None:
    import os

    cpu_worker_fork.register()
    assert os.environ[METHOD] == "fork"


def test_a_ray_process_keeps_spawning(spawned_engine_core: pytest.MonkeyPatch) -> None:
    import os

    spawned_engine_core.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    cpu_worker_fork.register()
    assert os.environ[METHOD] == "spawn"


def test_it_can_be_turned_off(spawned_engine_core: pytest.MonkeyPatch) -> None:
    import os

    spawned_engine_core.setenv("ART_RAY_CPU_WORKER_FORK", "0")
    cpu_worker_fork.register()
    assert os.environ[METHOD] == "spawn"


def test_vllm_loads_it_as_a_general_plugin() -> None:
    from importlib.metadata import entry_points

    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins["art_ray_cpu_worker_fork"] == "art_ray.serving.cpu_worker_fork:register"
