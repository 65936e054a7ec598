"""Placement from the cluster's nodes: layouts, reservations, GPU configs validated by vLLM's and
DeepSpeed's own config code, and fail-fast errors for layouts the cluster cannot hold."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from art_ray import ModelConfig
from art_ray.placement import NodeShape, PlacementError, plan_model, unplaced, wait_placeable


def node(name: str, cpus: float, gpus: float = 0, live: bool = True, **custom: float) -> NodeShape:
    total = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **custom}
    return NodeShape(name=name, total=total, available=dict(total), live=live)


def test_one_cpu_box_is_colocated_with_every_core_on_both_sides() -> None:
    plan = plan_model(ModelConfig(), [node("box", 2)])
    assert (plan.layout, plan.engine_device, plan.trainer_device) == ("colocated", "cpu", "cpu")
    assert plan.engine_threads is None and plan.trainer_threads is None  # every core, resolved in the actor
    assert plan.replica.demand() == {"CPU": 1.0} and plan.trainer_rank.demand() == {"CPU": 1.0}


def test_cpu_nodes_pinned_apart_are_split_and_keep_to_their_cpus() -> None:
    nodes = [node("a", 4, inference_node=1), node("b", 4, trainer_node=1)]
    config = ModelConfig(replica_resources={"inference_node": 0.1}, trainer_resources={"trainer_node": 0.1})
    plan = plan_model(config, nodes)
    assert plan.layout == "split" and (plan.engine_threads, plan.trainer_threads) == (1, 1)


def test_a_gpu_node_behind_a_cpu_head_plans_gpus_not_the_drivers_cpu() -> None:
    head, gpu = node("head", 8), node("g", 8, gpus=1)
    plan = plan_model(ModelConfig(), [head, gpu])
    assert (plan.layout, plan.engine_device, plan.trainer_device) == ("colocated", "gpu", "gpu")
    assert plan.replica.num_gpus == 0.5 and plan.trainer_rank.num_gpus == 0.5  # they share the one GPU
    enough = plan_model(ModelConfig(), [head, node("g4", 32, gpus=4)])
    assert enough.layout == "split" and enough.replica.num_gpus == 1 and enough.trainer_rank.num_gpus == 1
    tp = plan_model(ModelConfig(tensor_parallel_size=2, layout="split"), [head, node("g4", 32, gpus=4)])
    assert tp.replica.num_gpus == 2


def test_colocated_tensor_parallel_and_missing_resources_name_the_setting() -> None:
    with pytest.raises(PlacementError, match="tensor_parallel_size"):
        plan_model(ModelConfig(tensor_parallel_size=2, layout="colocated"), [node("g", 8, gpus=2)])
    with pytest.raises(PlacementError, match="replica_resources"):
        plan_model(ModelConfig(replica_resources={"tpu_node": 1}), [node("g", 8, gpus=2)])


def test_autoscaler_node_types_count_for_the_device_and_the_wait() -> None:
    # cluster.yaml starts with the head only: the GPU worker types exist as autoscaler node types
    shapes = [node("head", 8), node("inference_gpu", 8, gpus=1, live=False, inference_node=1)]
    plan = plan_model(ModelConfig(replica_resources={"inference_node": 0.01}), shapes)
    assert plan.engine_device == "gpu"
    assert unplaced([plan.replica.demand()], shapes) == [plan.replica.demand()]

    async def wait(timeout_s: float) -> float:
        start = time.monotonic()
        with pytest.raises(PlacementError, match="placement_timeout_s") as error:
            demands = [plan.replica.demand()]
            await wait_placeable(demands, "the app", "replica_gpus", timeout_s, lambda: shapes)
        assert "GPU" in str(error.value)
        return time.monotonic() - start

    assert 1.0 <= asyncio.run(wait(1.5)) < 10  # it waited for the autoscaler, then gave up
    with pytest.raises(PlacementError, match="no node of this cluster"):  # no node type is large enough
        asyncio.run(wait_placeable([{"GPU": 8}], "the trainer", "world_size", 60, lambda: shapes))


def test_simulated_gpu_cluster_gets_gpu_configs_valid_for_vllm_and_deepspeed(tmp_path: Path) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    from art_ray.serving.config import ServingConfig
    from art_ray.serving.vllm_app import vllm_namespace

    driver = Path(__file__).with_name("simulated_gpu_cluster.py")
    completed = subprocess.run(
        [sys.executable, str(driver), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["driver_sees_gpu"] is False  # the plan below came from the cluster, not this process

    split = result["split"]
    assert split["plan"]["layout"] == "split"
    assert split["serving"]["replica_gpus"] == 1 and split["serving"]["replica_resources"]
    assert split["trainer"]["device"] == "gpu" and split["trainer"]["rank"]["num_gpus"] == 1
    kwargs = split["engine_kwargs"]
    assert kwargs["dtype"] == "auto" and kwargs["gpu_memory_utilization"] == 0.85
    assert "block_size" not in kwargs and kwargs["enforce_eager"] is False
    assert "enable_sleep_mode" not in kwargs
    one_gpu = result["one_gpu"]
    assert one_gpu["plan"]["layout"] == "colocated"
    assert one_gpu["plan"]["replica"]["num_gpus"] + one_gpu["plan"]["trainer_rank"]["num_gpus"] <= 1
    assert one_gpu["engine_kwargs"]["enable_sleep_mode"] is True
    assert one_gpu["trainer"]["colocated"] is True

    for case in (split, one_gpu):
        args = vllm_namespace(ServingConfig.model_validate(case["serving"]))  # vLLM's own parser
        assert args.dtype == "auto" and args.enable_lora is True
        assert args.enable_sleep_mode is (case is one_gpu)
        deepspeed = DeepSpeedConfig(case["deepspeed"])  # DeepSpeed's own config class
        assert deepspeed.bfloat16_config.enabled is True
    assert DeepSpeedConfig(split["deepspeed"]).zero_optimization_stage == 3
    assert DeepSpeedConfig(one_gpu["deepspeed"]).zero_optimization_stage == 2


async def test_a_model_the_cluster_cannot_hold_fails_fast_and_leaves_nothing(ray_cluster, tmp_path) -> None:
    """The session's cluster has 4 CPUs and no autoscaler: a trainer of 64 CPUs is refused at once,
    before the app or a placement group is created."""
    import ray
    from factories import TINY_CONFIG
    from ray import serve

    from art_ray import RayBackend, TrainableModel
    from art_ray.models import TINY

    backend = RayBackend(storage=str(tmp_path), app_name="never", route_prefix="/never")
    config = TINY_CONFIG.model_copy(update={"trainer_cpus_per_rank": 64.0})
    model = TrainableModel(name="too-big", project="tests", base_model=TINY, config=config)

    def pending() -> set[str]:
        return {pg for pg, info in ray.util.placement_group_table().items() if info["state"] == "PENDING"}

    pending_before = pending()
    start = time.monotonic()
    with pytest.raises(PlacementError, match="trainer_cpus_per_rank") as error:
        await model.register(backend)
    assert time.monotonic() - start < 15
    assert "{'CPU': 64.0}" in str(error.value)
    assert pending() <= pending_before
    assert "never" not in serve.status().applications
    assert backend._trainers == {} and backend.base_url is None
