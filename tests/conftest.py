"""Session fixtures: one local Ray cluster and one inference app shared by all integration tests.

Each vLLM engine start costs ~30 s on the 2-core CI box, so the app starts once per session.

The box has 24 GiB, and the session's apps, engines and trainers do not all fit beside a test that starts a
cluster of its own (the last CI runs lost workers to Ray's OOM killer). So the tests run in three blocks:
those that need no session cluster first (unit tests, and the tests that start their own cluster in a
subprocess, with the machine to themselves), then the users of the SmolLM2 app, which is shut down after
its last user, then the rest.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# vLLM's own default level, kept for the session: importing TRL (the parity tests) sets
# VLLM_LOGGING_LEVEL=ERROR unless it is set (trl/_compat.py), and the session cluster, started later from
# this process, would pass that to every replica: their vLLM lines, which tests read, would be gone.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")

API_KEY = "test-key"
MODEL = "agent"
CHECKPOINT_MODEL = "served-checkpoint"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def inference_replicas(app_name: str) -> list:
    """Handles of an app's inference replica actors (each answers `__ray_call__` in its own process)."""
    import ray

    from art_ray.adapters.registry import INFERENCE_DEPLOYMENT

    prefix = f"SERVE_REPLICA::{app_name}#{INFERENCE_DEPLOYMENT}"
    return [
        ray.get_actor(actor["name"], namespace=actor["namespace"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(prefix)
    ]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # 4 logical CPUs on 2 cores: two engine replicas plus the trainer get one each; they mostly wait.
    # Workers import functions defined in test modules (remote rollouts), as a job's working_dir would
    # let them: tests/ goes on their path, and the examples' helpers that bench/learning.py's rollouts use.
    examples = Path(__file__).parents[1] / "examples"
    # the checkout under test first: workers import its art_ray, not an installed one
    folders = [
        Path(__file__).parents[1],
        Path(__file__).parent,
        examples,
        examples / "code_math",
        examples / "email_agent",
        examples / "terminal_agent",
    ]
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(map(str, folders))}},
    )
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@dataclass
class InferenceApp:
    base_url: str
    api_key: str
    base_model: str
    app_name: str
    model: str


@pytest.fixture(scope="session")
def inference_app(ray_cluster, tmp_path_factory) -> InferenceApp:
    import torch

    from art_ray.adapters.lora_files import initial_adapter, write_peft_adapter
    from art_ray.adapters.registry import publish_adapter
    from art_ray.adapters.spec import LoRASpec
    from art_ray.models import TINY, default_tool_call_parser, prepare
    from art_ray.serving.config import ServedCheckpoint, ServingConfig
    from art_ray.serving.engine_config import EngineConfig
    from art_ray.serving.launch import start_inference

    base_model = str(prepare(TINY))
    spec = LoRASpec(r=8, alpha=16)
    # a "trained" checkpoint the app serves from its folder at start (B != 0, so it changes outputs)
    generator = torch.Generator().manual_seed(1)
    trained = {
        name: torch.randn(tensor.shape, generator=generator) if ".lora_B." in name else tensor
        for name, tensor in initial_adapter(base_model, spec).items()
    }
    checkpoint = write_peft_adapter(tmp_path_factory.mktemp("ckpt") / "adapter", trained, spec, base_model)
    config = ServingConfig(
        engine=EngineConfig(model=base_model, max_model_len=512, threads=1),
        default_max_tokens=48,
        num_replicas=2,
        replica_cpus=1,
        api_key=API_KEY,
        keep_versions=3,
        tool_call_parser=default_tool_call_parser(TINY),
        checkpoints=[ServedCheckpoint(model=CHECKPOINT_MODEL, step=5, path=str(checkpoint))],
    )
    base_url = start_inference(config, port=free_port())
    asyncio.run(publish_adapter(MODEL, 0, base_model, spec, initial_adapter(base_model, spec)))
    os.environ.pop("OPENAI_API_KEY", None)
    return InferenceApp(
        base_url=base_url, api_key=API_KEY, base_model=base_model, app_name=config.app_name, model=MODEL
    )


def stop_trainer(backend, name: str) -> None:  # noqa: ANN001
    """Free a model's trainer (a SmolLM2 rank holds ~1 GB) once its tests are done; its checkpoints stay."""
    backend._trainers.pop(name).shutdown()
    backend._trackers.pop(name, None)


@dataclass
class SmolModel:
    backend: object
    model: object


# Session resources shut down once their last user has run (see pytest_runtest_teardown).
_RELEASED_AFTER_LAST_USE = ("smollm2_model",)
_live: dict[str, object] = {}
_last_users: dict[str, str] = {}


def _block(item: pytest.Item) -> int:
    names = item.fixturenames
    if "ray_cluster" not in names:
        return 0
    return 1 if "smollm2_model" in names else 2


def pytest_collection_modifyitems(session, config, items: list[pytest.Item]) -> None:
    items.sort(key=_block)  # stable: file order within a block
    for item in items:
        for fixture in _RELEASED_AFTER_LAST_USE:
            if fixture in item.fixturenames:
                _last_users[fixture] = item.nodeid


@pytest.hookimpl(trylast=True)  # after the item's module fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for fixture, last_user in _last_users.items():
        if last_user == item.nodeid and fixture in _live:
            _live.pop(fixture).backend.shutdown()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
async def smollm2_model(ray_cluster, tmp_path_factory) -> SmolModel:
    """SmolLM2-135M-Instruct served and trainable through a RayBackend of its own ("smol" at /smol):
    the tests that need a model that follows instructions (tool calls, a judge) share it."""
    from art_ray import LoRASpec, ModelConfig, RayBackend, TrainableModel

    backend = RayBackend(
        storage=str(tmp_path_factory.mktemp("smol")), port=free_port(), app_name="smol", route_prefix="/smol"
    )
    model = TrainableModel(
        name="smol",
        project="tests",
        base_model="smollm2-135m",
        config=ModelConfig(
            lora=LoRASpec(r=8, alpha=16),
            sequence_length=512,
            max_model_len=1024,
            replica_cpus=0,
            trainer_cpus_per_rank=0,
        ),
    )
    await model.register(backend)
    _live["smollm2_model"] = smol = SmolModel(backend=backend, model=model)
    yield smol
    backend.shutdown()  # a no-op when it was released after its last user
