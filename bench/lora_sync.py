"""Time from publish to "served on all replicas": object-store broadcast vs the disk path.

Broadcast: the registry puts the adapter tensors in the Ray object store once and every replica
fetches them, writes node-local files and loads them (what the trainer does after each step).
Disk path: write the PEFT folder to disk, then every replica loads that folder (vLLM's
`load_lora_adapter`); it needs a filesystem shared by all nodes, which the broadcast does not.
SmolLM2-135M, LoRA r=16 on q/k/v/o, 1 and 2 replicas, median of --repeats publishes.
Last line: {"bench": "lora_sync", "seconds_2_replicas": ..., "ratio": broadcast / disk (2 replicas), ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, median, print_result, print_table, start_local_ray  # noqa: E402

from art_ray.adapters.lora_files import adapter_shapes, initial_adapter, write_peft_adapter  # noqa: E402
from art_ray.adapters.spec import LoRASpec  # noqa: E402
from art_ray.models import resolve_base_model  # noqa: E402
from art_ray.serving.config import ServingConfig  # noqa: E402
from art_ray.serving.engine_config import EngineConfig  # noqa: E402

SPEC = LoRASpec(r=16, alpha=32)


def random_tensors(shapes: dict, seed: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * 0.01 for name, shape in shapes.items()}


async def measure(
    config: ServingConfig, base_model: str, shapes: dict, repeats: int, first_step: int
) -> tuple[float, float]:
    from ray import serve

    from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, publish_adapter

    handle = serve.get_deployment_handle(INFERENCE_DEPLOYMENT, config.app_name)
    broadcast, disk = [], []
    for i in range(repeats):
        tensors = random_tensors(shapes, seed=first_step + i)
        start = time.perf_counter()
        replicas = await publish_adapter("sync", first_step + i, base_model, SPEC, tensors)
        broadcast.append(time.perf_counter() - start)
        assert replicas == config.num_replicas, replicas

        start = time.perf_counter()
        folder = Path(tempfile.mkdtemp()) / "adapter"
        write_peft_adapter(folder, tensors, SPEC, base_model)
        results = await handle.broadcast(
            "load_adapter_folder", "disk", first_step + i, str(folder)
        ).results_async()
        disk.append(time.perf_counter() - start)
        assert len(results) == config.num_replicas
    return median(broadcast), median(disk)


async def run(args: argparse.Namespace) -> dict:

    from art_ray.adapters.registry import publish_adapter
    from art_ray.serving.launch import start_inference, stop_local_cluster

    base_model = resolve_base_model(args.model)
    shapes = adapter_shapes(base_model, SPEC)
    size_mb = sum(4 * math.prod(shape) for shape in shapes.values()) / 1e6
    start_local_ray()
    port = free_port()
    config = ServingConfig(
        engine=EngineConfig(model=base_model, max_model_len=1024, threads=1), replica_cpus=1
    )
    start_inference(config, port=port)
    await publish_adapter("sync", 0, base_model, SPEC, initial_adapter(base_model, SPEC))
    one = await measure(config, base_model, shapes, args.repeats, first_step=1)
    config = config.model_copy(update={"num_replicas": 2})
    start_inference(config, port=port)
    two = await measure(config, base_model, shapes, args.repeats, first_step=100)
    stop_local_cluster()
    print_table(
        f"publish -> served on all replicas, {args.model}, LoRA r={SPEC.r} ({size_mb:.1f} MB), "
        f"median of {args.repeats}",
        ["replicas", "broadcast s", "disk path s", "ratio"],
        [[1, one[0], one[1], one[0] / one[1]], [2, two[0], two[1], two[0] / two[1]]],
    )
    return {
        "bench": "lora_sync",
        "seconds_1_replica": round(one[0], 4),
        "seconds_2_replicas": round(two[0], 4),
        "disk_seconds_1_replica": round(one[1], 4),
        "disk_seconds_2_replicas": round(two[1], 4),
        "ratio": round(two[0] / two[1], 3),
        "adapter_mb": round(size_mb, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    result = asyncio.run(run(parser.parse_args()))
    print_result(result)


if __name__ == "__main__":
    main()
