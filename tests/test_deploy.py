"""Offline validation of the deployment files: cluster.yaml against Ray's cluster-config schema, the Serve
config files and the KubeRay manifests against Serve's schema and art-ray's own config models."""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from art_ray.serving.config import ServingConfig

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIGS = ["deploy/serve_config.yaml", "deploy/serve_trained.yaml"]


def load(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def test_cluster_yaml_passes_rays_own_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load("cluster.yaml")
    prepared = prepare_config(copy.deepcopy(raw))  # fills the AWS defaults; no cloud call
    validate_config(prepared)  # ray-schema.json plus the launcher's own checks
    types = prepared["available_node_types"]
    assert types["inference_gpu"]["resources"] == {"inference_node": 1}
    assert types["trainer_gpu"]["resources"] == {"trainer_node": 1}
    assert types["sandbox_cpu"]["resources"] == {"sandbox": 1}  # where SharedSandboxes' hosts go
    assert types["sandbox_cpu"]["min_workers"] >= 1 and "InstanceType" in types["sandbox_cpu"]["node_config"]
    kinds = ("inference_gpu", "trainer_gpu", "sandbox_cpu")
    assert all(types[t]["max_workers"] >= types[t]["min_workers"] for t in kinds)
    assert any("art-ray[gpu]" in command for command in raw["setup_commands"])
    assert any("--dashboard-host=0.0.0.0" in command for command in raw["head_start_ray_commands"])


def test_a_cluster_yaml_with_a_typo_is_rejected() -> None:
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = load("cluster.yaml")
    broken["available_node_types"]["inference_gpu"]["min_worker"] = 1  # not a field
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def serving_configs(serve_config: dict) -> list[ServingConfig]:
    schema = ServeDeploySchema.model_validate(serve_config)
    assert all(app.import_path == "art_ray.serving.entrypoint:app_builder" for app in schema.applications)
    return [ServingConfig.model_validate(app.args) for app in schema.applications]


@pytest.mark.parametrize("path", SERVE_CONFIGS)
def test_serve_config_files_validate(path: str) -> None:
    assert serving_configs(load(path))


def test_the_trained_endpoint_serves_a_checkpoint_with_a_key() -> None:
    (config,) = serving_configs(load("deploy/serve_trained.yaml"))
    assert config.api_key and [c.step for c in config.checkpoints] == [8]
    assert config.checkpoints[0].path.endswith("/checkpoints/0008/adapter")


def test_kuberay_rayservice_embeds_a_valid_serve_config() -> None:
    service = load("deploy/kuberay/rayservice.yaml")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    (config,) = serving_configs(yaml.safe_load(service["spec"]["serveConfigV2"]))
    assert config.replica_gpus == 1 and config.tool_call_parser == "hermes"
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]


def test_kuberay_rayjob_runs_an_example_with_valid_arguments() -> None:
    job = load("deploy/kuberay/rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[0] == "python" and (ROOT / command[1]).is_file()
    spec = importlib.util.spec_from_file_location("rayjob_entrypoint", ROOT / command[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parse_args(command[2:])  # the example accepts the job's arguments
    assert args.storage.startswith("s3://") and args.tracking_uri.startswith("http")
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert set(runtime_env) <= {"working_dir", "env_vars", "pip", "py_modules"}
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    resources = {
        name: json.loads(json.loads(group["rayStartParams"]["resources"])) for name, group in groups.items()
    }
    assert resources == {"inference-gpu": {"inference_node": 1}, "trainer-gpu": {"trainer_node": 1}}


def test_kuberay_terminal_agent_job_has_a_sandbox_group_and_valid_arguments() -> None:
    import sys

    job = load("deploy/kuberay/rayjob-terminal-agent.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[:2] == ["python", "examples/terminal_agent/train.py"]
    sys.path.insert(0, str(ROOT / "examples"))
    from loop import parse_args

    args = parse_args("terminal_agent", "", command[2:])
    assert args.storage.startswith("s3://") and args.group_size == 16
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert json.loads(json.loads(groups["sandbox-cpu"]["rayStartParams"]["resources"])) == {"sandbox": 1}
    pod = groups["sandbox-cpu"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["hostUsers"] is False and container["securityContext"]["procMount"] == "Unmasked"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
