"""Placement: where a model's engine replicas and trainer ranks run, on which device, with how many
threads, and whether they share the hardware (colocated) or not (split).

Decided from the Ray cluster's own nodes (and the node types its autoscaler may add), never from the
driver process's devices: a `ray job submit` driver runs on a head that usually has no GPU. The planning
itself is pure (no ray import): `cluster_shapes()` reads the cluster, `plan_model()` decides,
`unplaced()` checks that what is about to be created fits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

import pydantic

from art_ray.errors import ArtRayError
from art_ray.model_config import ModelConfig

logger = logging.getLogger(__name__)

Device = Literal["cpu", "gpu"]
Layout = Literal["colocated", "split"]
# How long a cluster without an autoscaler gets to release resources (removed placement groups) before a
# layout that does not fit is refused.
RELEASE_GRACE_S = 5.0
# A colocated GPU holds one engine replica and one trainer rank; each reserves half of it.
COLOCATED_GPU_SHARE = 0.5


class PlacementError(ArtRayError, RuntimeError):
    """A model's layout cannot be placed on this cluster; the message names the setting to change."""


class NodeShape(pydantic.BaseModel):
    """A live node (available: free now) or a node type the autoscaler can add (available: its total)."""

    name: str
    total: dict[str, float]
    available: dict[str, float]
    live: bool = True

    @property
    def gpus(self) -> float:
        return self.total.get("GPU", 0.0)

    def offers(self, keys: dict[str, float]) -> bool:
        """Whether this node carries every custom resource a role is pinned with."""
        return all(self.total.get(key, 0.0) > 0 for key in keys)


class Reservation(pydantic.BaseModel):
    """What Ray reserves for one engine replica or one trainer rank."""

    num_cpus: float = pydantic.Field(ge=0)
    num_gpus: float = pydantic.Field(default=0.0, ge=0)
    resources: dict[str, float] = pydantic.Field(default_factory=dict)

    def demand(self) -> dict[str, float]:
        demand = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {key: value for key, value in demand.items() if value > 0}


class ModelPlan(pydantic.BaseModel):
    layout: Layout
    engine_device: Device
    trainer_device: Device
    replica: Reservation  # one replica, all of its tensor-parallel GPUs
    trainer_rank: Reservation
    # CPU threads of the engine and of each trainer rank; None: every core of the node the actor runs on
    # (resolved in the actor, where the node's cores are known).
    engine_threads: int | None
    trainer_threads: int | None

    def describe(self) -> str:
        def threads(value: int | None) -> str:
            return "all cores" if value is None else f"{value} thread{'s' * (value != 1)}"

        return (
            f"layout {self.layout}: engine on {self.engine_device} ({self.replica.demand()} per replica, "
            f"{threads(self.engine_threads)}), trainer on {self.trainer_device} "
            f"({self.trainer_rank.demand()} per rank, {threads(self.trainer_threads)})"
        )


def plan_model(config: ModelConfig, shapes: list[NodeShape]) -> ModelPlan:
    """Decide the layout, devices, reservations and threads of a model from the cluster's nodes."""
    replica_nodes = role_nodes(shapes, config.replica_resources, "replica_resources")
    trainer_nodes = role_nodes(shapes, config.trainer_resources, "trainer_resources")
    engine_device = _device(config, replica_nodes)
    trainer_device = _device(config, trainer_nodes)
    layout = config.layout
    if layout == "auto":
        layout = _auto_layout(config, engine_device, trainer_device, replica_nodes, trainer_nodes)
    tp = config.tensor_parallel_size
    if layout == "colocated" and engine_device == "gpu":
        if tp != 1:
            raise PlacementError(
                f"a colocated GPU holds one engine replica and one trainer rank: tensor_parallel_size={tp} "
                'needs layout="split" (or tensor_parallel_size=1)'
            )
        replica_gpus = config.replica_gpus if config.replica_gpus is not None else COLOCATED_GPU_SHARE
        rank_gpus = (
            config.trainer_gpus_per_rank if config.trainer_gpus_per_rank is not None else COLOCATED_GPU_SHARE
        )
    else:
        whole = 1.0 if engine_device == "gpu" else 0.0
        replica_gpus = (config.replica_gpus if config.replica_gpus is not None else whole) * tp
        rank_gpus = config.trainer_gpus_per_rank
        if rank_gpus is None:
            rank_gpus = 1.0 if trainer_device == "gpu" else 0.0
    colocated_cpu = layout == "colocated" and engine_device == "cpu"
    return ModelPlan(
        layout=layout,
        engine_device=engine_device,
        trainer_device=trainer_device,
        replica=Reservation(
            num_cpus=config.replica_cpus, num_gpus=replica_gpus, resources=config.replica_resources
        ),
        trainer_rank=Reservation(
            num_cpus=config.trainer_cpus_per_rank, num_gpus=rank_gpus, resources=config.trainer_resources
        ),
        # Colocated on CPU each phase runs on every core while the other side waits; split, each side
        # keeps to the CPUs it reserved.
        engine_threads=config.engine_threads or (None if colocated_cpu else _whole(config.replica_cpus)),
        trainer_threads=config.trainer_threads
        or (None if colocated_cpu else _whole(config.trainer_cpus_per_rank)),
    )


def _whole(cpus: float) -> int:
    return max(1, int(cpus))


def role_nodes(shapes: list[NodeShape], pinned: dict[str, float], setting: str) -> list[NodeShape]:
    nodes = [shape for shape in shapes if shape.offers(pinned)]
    if not nodes:
        raise PlacementError(
            f"no node of this cluster (nor a node type its autoscaler can add) has the resources "
            f"{sorted(pinned)} of ModelConfig.{setting}={pinned}; set it to resources your nodes advertise "
            f"(ray start --resources / cluster.yaml node types)"
        )
    return nodes


def _device(config: ModelConfig, nodes: list[NodeShape]) -> Device:
    return resolve_device(config.device, nodes)


def resolve_device(device: Literal["auto", "cpu", "gpu"], nodes: list[NodeShape]) -> Device:
    """`device`, with "auto" decided by the nodes that can run the role: GPU when any has GPUs."""
    if device != "auto":
        return device
    return "gpu" if any(node.gpus > 0 for node in nodes) else "cpu"


def _auto_layout(
    config: ModelConfig,
    engine_device: Device,
    trainer_device: Device,
    replica_nodes: list[NodeShape],
    trainer_nodes: list[NodeShape],
) -> Layout:
    """Colocated wherever engine and trainer would otherwise share devices: one CPU box, or fewer GPUs
    than the split layout asks for (one replica GPU set plus one GPU per trainer rank)."""
    if engine_device != trainer_device:
        return "split"
    names = {node.name for node in replica_nodes} | {node.name for node in trainer_nodes}
    if engine_device == "cpu":
        return "colocated" if len(names) == 1 and all(node.live for node in replica_nodes) else "split"
    if {n.name for n in replica_nodes} != {n.name for n in trainer_nodes}:
        return "split"  # pinned to different node types: they never share a device
    gpus = sum(node.gpus for node in replica_nodes)
    replicas = config.autoscaling.max_replicas if config.autoscaling else config.num_replicas
    needed = replicas * config.tensor_parallel_size + config.world_size
    return "colocated" if gpus < needed else "split"


def _fits(demand: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(key, 0.0) + 1e-9 >= value for key, value in demand.items())


def unplaced(demands: list[dict[str, float]], shapes: list[NodeShape]) -> list[dict[str, float]]:
    """The demands (largest first) that do not fit into the live nodes' free resources, packing
    greedily; an empty list means everything can be placed now."""
    free = [dict(shape.available) for shape in shapes if shape.live]
    missing = []
    for demand in sorted(demands, key=lambda d: (d.get("GPU", 0.0), d.get("CPU", 0.0)), reverse=True):
        node = next((node for node in free if _fits(demand, node)), None)
        if node is None:
            missing.append(demand)
            continue
        for key, value in demand.items():
            node[key] -= value
    return missing


def could_ever_fit(demand: dict[str, float], shapes: list[NodeShape]) -> bool:
    """Whether some node, live or one the autoscaler may add, is large enough for the demand."""
    return any(_fits(demand, shape.total) for shape in shapes)


def cluster_shapes() -> list[NodeShape]:
    """The connected cluster's live nodes (with what is free on each) and the autoscaler's node types."""
    import ray
    from ray._private import state

    available = state.state.available_resources_per_node()
    shapes = [
        NodeShape(
            name=node["NodeID"],
            total={k: v for k, v in node["Resources"].items() if not k.startswith("node:")},
            available={
                k: v for k, v in available.get(node["NodeID"], {}).items() if not k.startswith("node:")
            },
        )
        for node in ray.nodes()
        if node["Alive"]
    ]
    cluster_config = state.state.get_cluster_config()
    for group in cluster_config.node_group_configs if cluster_config is not None else []:
        if group.max_count != 0 and group.resources:
            resources = dict(group.resources)
            shapes.append(NodeShape(name=group.name, total=resources, available=resources, live=False))
    return shapes


def _free_summary(shapes: list[NodeShape]) -> str:
    nodes = [shape for shape in shapes if shape.live]
    return "; ".join(
        f"node {shape.name[:8]}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(shape.available.items()))
        for shape in nodes
    )


async def wait_placeable(
    demands: list[dict[str, float]],
    what: str,
    settings: str,
    timeout_s: float,
    read: Callable[[], list[NodeShape]] = cluster_shapes,
) -> None:
    """Return once `demands` fit into the cluster's free resources. Raise PlacementError at once when no
    node could ever hold one of them, or when they do not fit now and no autoscaler can add a node; wait
    (saying so) up to `timeout_s` for an autoscaler that can. `settings` names what the user can change."""
    start = last_note = time.monotonic()
    while True:
        shapes = read()
        too_large = [demand for demand in demands if not could_ever_fit(demand, shapes)]
        if too_large:
            raise PlacementError(
                f"{what} needs {too_large[0]} on one node, and no node of this cluster (nor a node type its "
                f"autoscaler can add) is that large; change {settings}"
            )
        missing = unplaced(demands, shapes)
        if not missing:
            return
        can_grow = any(not shape.live for shape in shapes)
        waited = time.monotonic() - start
        # Without an autoscaler only resources being released (a trainer just stopped) can still come.
        if waited >= (timeout_s if can_grow else min(timeout_s, RELEASE_GRACE_S)):
            reason = (
                f"waited {waited:.0f} s for the autoscaler (ModelConfig.placement_timeout_s)"
                if can_grow
                else "and this cluster has no autoscaler to add nodes"
            )
            raise PlacementError(
                f"{what} needs {missing} more than the cluster has free ({_free_summary(shapes)}), {reason}; "
                f"stop what holds those resources or change {settings}"
            )
        if time.monotonic() - last_note >= 10:
            logger.warning("%s waits for the autoscaler to add a node for %s (%.0f s)", what, missing, waited)
            last_note = time.monotonic()
        await asyncio.sleep(1.0)
