"""`import art_ray` stays light: the SDK's types, configs and HTTPBackend load no torch, ray, vllm or
deepspeed (nor openai until a Choice or a client is needed); RayBackend and friends load on first use."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = {"torch", "ray", "vllm", "deepspeed", "mlflow", "pyarrow", "transformers", "openai"}


def top_level_modules_after(code: str) -> set[str]:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return set(json.loads(completed.stdout.strip().splitlines()[-1]))


def test_the_sdk_floor_loads_no_heavy_package() -> None:
    loaded = top_level_modules_after(
        "import art_ray\n"
        "from art_ray import HTTPBackend, ModelConfig, TrainConfig, TrainResult, TrainableModel, Trajectory\n"
        "ModelConfig(); TrainableModel(name='m', project='p', base_model='b')\n"
        "Trajectory(messages_and_choices=[{'role': 'user', 'content': 'hi'}], reward=1.0)\n"
        "HTTPBackend('http://127.0.0.1:1')"
    )
    assert not loaded & HEAVY, sorted(loaded & HEAVY)


def test_ray_backend_and_remote_rollout_load_on_first_use() -> None:
    loaded = top_level_modules_after("from art_ray import RayBackend, remote_rollout, read_trajectory_groups")
    assert {"ray", "pyarrow"} <= loaded


def test_a_ray_backend_driver_loads_no_torch() -> None:
    """What the driver imports to register and train (the backend, the trainer group it creates actors
    from, the inference app's launcher): torch, vLLM and DeepSpeed load only where they run (~130 MiB
    of torch in a driver otherwise)."""
    loaded = top_level_modules_after(
        "import art_ray.backend, art_ray.trainer.group, art_ray.serving.launch, art_ray.rollout_runner"
    )
    assert "ray" in loaded
    assert not loaded & {"torch", "vllm", "deepspeed", "transformers"}, sorted(loaded & HEAVY)


def test_a_choice_is_still_a_choice() -> None:
    from openai.types.chat.chat_completion import Choice

    from art_ray import Trajectory

    choice = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Paris"}}
    )
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "Capital?"}, choice])
    assert trajectory.trainable_choices() == [choice]
    back = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert isinstance(back.messages_and_choices[1], Choice) and back.messages_and_choices[1] == choice
    assert back.messages()[1] == {"role": "assistant", "content": "Paris"}


def test_every_lazy_name_is_what_it_names_after_its_module_loaded() -> None:
    """A lazy name must not share its module's name: importing `art_ray.x` sets the package's attribute
    `x` to the module, so `@art_ray.remote_rollout` in a worker that had already loaded the runner module
    once decorated with a module (TypeError: 'module' object is not callable)."""
    import art_ray

    for name, module in art_ray._ON_FIRST_USE.items():
        assert module.rsplit(".", 1)[-1] != name, f"art_ray.{name} shares its module's name ({module})"
    code = (
        "import importlib, art_ray\n"
        "for name, module in art_ray._ON_FIRST_USE.items():\n"
        "    importlib.import_module(module)\n"
        "for name in art_ray._ON_FIRST_USE:\n"
        "    value = getattr(art_ray, name)\n"
        "    assert not isinstance(value, type(art_ray)), name\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]


def test_the_sandbox_package_loads_no_heavy_package() -> None:
    """A rollout process or a reward function leases sandboxes without torch or ray (the Ray host actor,
    art_ray/sandbox/host.py, is the one module that imports ray)."""
    loaded = top_level_modules_after(
        "from art_ray.sandbox import SandboxLimits, SandboxPool, run_tests\n"
        "SandboxLimits(); SandboxPool(slots=1)"
    )
    assert not loaded & HEAVY, sorted(loaded & HEAVY)
