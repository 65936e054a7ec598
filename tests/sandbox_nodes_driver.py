"""Driver for tests/test_sandbox_ray.py, run in its own process (the test session holds its own Ray).

Simulates cluster.yaml's sandbox node type with `ray.cluster_utils.Cluster`: a head without the `sandbox`
resource (where the driver runs) and two CPU nodes that offer `{"sandbox": 1}`. A job's SharedSandboxes
must put a host on each of those nodes and none on the head, judged from the cluster's resources rather
than the driver's machine, and spread 12 overlapping leases on 2 x 2 slots over both. Prints, as its last
line, one JSON object.
"""

from __future__ import annotations

import asyncio
import json

import ray
from ray.cluster_utils import Cluster

from art_ray.sandbox import SandboxLimits, SharedSandboxes

SANDBOXES = SharedSandboxes(name="placed", slots=2, limits=SandboxLimits(wall_s=10), first_uid=174000)


async def lease(index: int) -> tuple[str, str]:
    async with SANDBOXES.lease(ttl_s=60) as box:
        result = await box.run(f"sleep 0.3; echo {index}")
        return result.stdout.strip(), await box.host.node_id.remote()


async def leases() -> list[tuple[str, str]]:
    return await asyncio.gather(*(lease(index) for index in range(12)))


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    sandbox_nodes = [cluster.add_node(num_cpus=1, resources={"sandbox": 1}).node_id for _ in range(2)]
    ray.init(address=cluster.address)
    done = asyncio.run(leases())
    stats = ray.get(ray.get_actor("placed").stats.remote())
    print(
        json.dumps(
            {
                "outputs": [output for output, _ in done],
                "nodes_used": sorted({node for _, node in done}),
                "sandbox_nodes": sorted(sandbox_nodes),
                "stats": stats,
            }
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
