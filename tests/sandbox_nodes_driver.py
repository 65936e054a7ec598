"""Driver for tests/test_sandbox_ray.py, run in its own process (the test session holds its own Ray).

Simulates cluster.yaml's sandbox node type with `ray.cluster_utils.Cluster`: a head without the `sandbox`
resource (where the driver runs) and a CPU node that offers `{"sandbox": 1}`. A `SharedSandboxes` left to
choose (`resources=None`) must put its host on that node, from the cluster's resources rather than the
driver's machine. Prints, as its last line, one JSON object.
"""

from __future__ import annotations

import asyncio
import json

import ray
from ray.cluster_utils import Cluster

from art_ray.sandbox import SandboxLimits, SharedSandboxes


async def lease_once(sandboxes: SharedSandboxes) -> str:
    async with sandboxes.lease(ttl_s=60) as box:
        return (await box.run("echo leased")).stdout.strip()


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    node = cluster.add_node(num_cpus=2, resources={"sandbox": 1})
    ray.init(address=cluster.address)
    sandboxes = SharedSandboxes(name="placed", slots=1, limits=SandboxLimits(wall_s=10), first_uid=174000)
    output = asyncio.run(lease_once(sandboxes))
    host = ray.get_actor("placed")
    print(
        json.dumps(
            {"output": output, "host_node": ray.get(host.node_id.remote()), "sandbox_node": node.node_id}
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
