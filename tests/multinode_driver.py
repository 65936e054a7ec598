"""Driver for tests/test_multinode.py, run in its own process (the test session holds its own Ray).

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`): the head is the trainer node, the worker
node the inference node, pinned by custom resources, each with its own temp folder (TMPDIR of its raylet)
so nothing passes through a shared path. Trains one step of the `tiny` model, records one completion in a
capture session, and prints, as its last line, one JSON object with where things ran and what the replica
served and recorded.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import openai
import ray
from ray.cluster_utils import Cluster

from art_ray import (
    LoRASpec,
    ModelConfig,
    RayBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
    sampled_tokens,
)

PROMPTS = ["Name a color.", "Say a number.", "Pick an animal."]


async def rollout(model: TrainableModel, prompt: str) -> Trajectory:
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=6, temperature=1.0
    )
    choice = completion.choices[0]
    return Trajectory(
        messages_and_choices=[*messages, choice], reward=float(sampled_tokens(choice).token_ids[0] % 2)
    )


def greedy(model: TrainableModel, name: str) -> str:
    client = openai.OpenAI(base_url=model.base_url, api_key="no-key", max_retries=0)
    response = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, temperature=0
    )
    return response.choices[0].message.content or ""


def actor_nodes() -> dict[str, str]:
    """Class name -> node id of the live actors (from the GCS actor table; no dashboard needed)."""
    return {
        info["ActorClassName"]: info["Address"]["NodeID"]
        for info in ray._private.state.actors().values()
        if info["State"] == "ALIVE"
    }


async def main(root: Path, port: int) -> dict:
    trainer_tmp, inference_tmp = root / "trainer_node", root / "inference_node"
    trainer_tmp.mkdir()
    inference_tmp.mkdir()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"trainer_node": 1},
            "object_store_memory": 300 * 1024 * 1024,
            "env_vars": {"TMPDIR": str(trainer_tmp)},
        },
    )
    cluster.add_node(
        num_cpus=2,
        resources={"inference_node": 1},
        object_store_memory=300 * 1024 * 1024,
        env_vars={"TMPDIR": str(inference_tmp)},
    )
    ray.init(address=cluster.address, log_to_driver=False)
    nodes = {
        name: node["NodeID"]
        for node in ray.nodes()
        for name in ("trainer_node", "inference_node")
        if name in node["Resources"]
    }
    backend = RayBackend(storage=str(trainer_tmp / "storage"), port=port, app_name="mn", route_prefix="/")
    model = TrainableModel(
        name="mn",
        project="multinode",
        base_model="tiny",
        config=ModelConfig(
            lora=LoRASpec(r=8, alpha=16),
            sequence_length=256,
            max_model_len=512,
            replica_resources={"inference_node": 1},
            trainer_resources={"trainer_node": 1},
        ),
    )
    try:
        await model.register(backend)
        before = greedy(model, "mn@0")
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(rollout(model, p) for _ in range(4)) for p in PROMPTS), pbar_desc=None
        )
        step = await model.train(groups, TrainConfig(learning_rate=5e-2, num_gradient_steps=2), verbose=False)
        async with model.capture() as session:  # recorded by the replica on the inference node
            completion = await session.openai_client(max_retries=0).chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=6
            )
            captured = await session.trajectory(reward=1.0)
        placed = actor_nodes()
        served = [m.id for m in openai.OpenAI(base_url=model.base_url, api_key="no-key").models.list()]
        return {
            "nodes": nodes,
            "trainer_node": placed.get("TrainerWorker"),
            "replica_node": placed.get("ServeReplica:mn:InferenceReplica"),
            "step": step,
            "capture_store_node": placed.get("CaptureStore"),
            "sampled_ids": list(completion.choices[0].model_extra["token_ids"]),
            "captured_ids": [list(sampled_tokens(c).token_ids) for c in captured.trainable_choices()],
            "served": served,
            "before": before,
            "after": greedy(model, "mn@1"),
            "still_step_0": greedy(model, "mn@0"),
            "checkpoints": sorted(p.name for p in (trainer_tmp / "storage").rglob("checkpoints/*")),
            # written by the replica under its own node's TMPDIR
            "replica_adapters": sorted(
                str(p.relative_to(inference_tmp)) for p in inference_tmp.rglob("mn/*")
            ),
            "trainer_tmp_adapters": sorted(str(p) for p in trainer_tmp.rglob("art_ray_adapters/*")),
        }
    finally:
        backend.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    result = asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
    print(json.dumps(result), flush=True)
