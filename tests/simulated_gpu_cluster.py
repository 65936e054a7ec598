"""Driver for tests/test_placement.py, run in its own process (the test session holds its own Ray).

Simulates cluster.yaml's layout with `ray.cluster_utils.Cluster` on this CPU-only machine: a head with no
GPU (where `ray job submit` runs the driver), an inference node with 1 GPU and a trainer node with 4 GPUs
(logical resources; nothing runs on them). Prints, as its last line, one JSON object with the plans and the
serving/trainer configs RayBackend builds for each case, as the driver on the head sees them.
"""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

from art_ray import ModelConfig, RayBackend, TrainableModel
from art_ray.placement import cluster_shapes, plan_model
from art_ray.trainer.engine import deepspeed_config


def configs(backend: RayBackend, model: TrainableModel) -> dict:
    plan = plan_model(model.config, cluster_shapes())
    serving = backend._serving_config(model, "/models/qwen", plan)
    trainer = backend._trainer_config(model, "/models/qwen", plan)
    return {
        "plan": plan.model_dump(),
        "serving": serving.model_dump(),
        "engine_kwargs": serving.engine.vllm_kwargs(),
        "trainer": trainer.model_dump(),
        "deepspeed": deepspeed_config(trainer, trainer.device == "gpu"),
    }


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0})
    cluster.add_node(num_cpus=8, num_gpus=1, resources={"inference_node": 1})
    cluster.add_node(num_cpus=16, num_gpus=4, resources={"trainer_node": 1})
    ray.init(address=cluster.address)
    backend = RayBackend(address=cluster.address, storage=sys.argv[1])
    pinned = ModelConfig(
        replica_resources={"inference_node": 0.01},
        trainer_resources={"trainer_node": 0.01},
        world_size=4,
        zero_stage=3,
    )
    result = {
        "driver_sees_gpu": __import__("torch").cuda.is_available(),
        # cluster.yaml's layout: replicas on the inference node, 4 trainer ranks on the trainer node
        "split": configs(backend, TrainableModel(name="a", project="p", base_model="x", config=pinned)),
        # pinned to the one-GPU node only: engine and trainer share its GPU
        "one_gpu": configs(
            backend,
            TrainableModel(
                name="b",
                project="p",
                base_model="x",
                config=ModelConfig(
                    replica_resources={"inference_node": 0.01},
                    trainer_resources={"inference_node": 0.01},
                    zero_stage=2,
                ),
            ),
        ),
    }
    ray.shutdown()
    cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
