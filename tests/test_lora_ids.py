"""A step published again (new weights, same name) while requests of its old weights still run: the engine
activates both adapter ids of a step and lives (art_ray/serving/lora_ids.py). Without the plugin
(ART_RAY_LORA_IDS=0) the same run kills the engine: `KeyError` in vLLM's convert_mapping, then
EngineDeadError, as in issue 49's 20-minute soak."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("lora_ids_driver.py")


def test_the_plugin_is_a_vllm_general_plugin() -> None:
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins["art_ray_lora_ids"] == "art_ray.serving.lora_ids:register"


LAZY = """
import json, sys
from art_ray.serving import lora_ids
lora_ids.register()
imported = [name for name in ("vllm.v1.worker.gpu.lora_utils", "vllm.lora.utils") if name in sys.modules]
from vllm.v1.worker.gpu.lora_utils import LoraState
from vllm.v1.worker.gpu_input_batch import InputBatch
lora_ids.register()
print(json.dumps({
    "imported_by_register": imported,
    "patched": [LoraState.get_activate_loras.__name__, InputBatch.make_lora_inputs.__name__],
    "finders_left": sum(isinstance(finder, lora_ids.PatchAfterImport) for finder in sys.meta_path),
}))
"""


def test_the_plugin_imports_no_model_runner_and_patches_each_as_it_is_imported() -> None:
    """The replica's API server loads vLLM's plugins but runs no model: registering imports nothing of the
    model runners', and each is patched when imported (as the engine's process does)."""
    run = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "imported_by_register": [],
        "patched": ["activate_by_id", "make_lora_inputs_by_id"],
        "finders_left": 0,
    }


def test_requests_of_a_steps_old_and_new_weights_share_a_batch_and_the_engine_lives() -> None:
    run = subprocess.run([sys.executable, str(DRIVER)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["R1_running_when_R2_came"], result  # both ids of `n@1` were in one batch
    assert result["R1"]["lora_int_id"] != result["R2"]["lora_int_id"], result
    assert result == {
        **result,
        "engine_alive": True,
        "R1": {**result["R1"], "tokens": 300},
        "R2": {**result["R2"], "tokens": 8},
        "after": {"lora_int_id": result["R2"]["lora_int_id"], "tokens": 4},
    }, result
