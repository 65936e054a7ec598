"""Sandboxes every rollout of a job leases from, wherever it runs: on Ray (rollouts in rollout runners),
the job's router of that name (router.py: a host on each sandbox node, leases first come first served to
the host with the most free slots), made by the first lease; without Ray (a driver that trains through
HTTPBackend runs its rollouts in place), a pool in this process.

    SANDBOXES = SharedSandboxes(name="my-agent", slots=4, limits=SandboxLimits(wall_s=5), first_uid=130000)

    async with SANDBOXES.lease() as box:  # in a rollout
        result = await box.python(code)

A SharedSandboxes holds only its settings, so a rollout function that names it pickles; the pools are
this module's, one per Ray job (a new session's router is another actor; a host that died is made again
while its node lives) or per event loop (a process that runs many short-lived loops should lease from one).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import pydantic

from art_ray.sandbox.namespaces import NamespaceBackend
from art_ray.sandbox.pool import SandboxPool
from art_ray.sandbox.types import LeasedSandbox, SandboxLimits

T = TypeVar("T")
# a local pool's uids start past this many hosts' (a simulated cluster's hosts share the machine)
LOCAL_UID_OFFSET_HOSTS = 64


class SharedSandboxes(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True)

    name: str
    slots: int = pydantic.Field(4, gt=0)
    limits: SandboxLimits = pydantic.Field(default_factory=SandboxLimits)
    # the hosts' slots run from first_uid on (slots uids per host), a local pool's from first_uid + 64 *
    # slots: two pools at once on one machine must not share uids (namespaces.py)
    first_uid: int = 100000
    # the custom resource of the nodes meant for sandboxes: a host on each node that offers it (cluster.yaml's
    # sandbox_cpu, KubeRay's sandbox group), one anywhere when none does
    node_resource: str = "sandbox"

    @contextlib.asynccontextmanager
    async def lease(self, ttl_s: float = 600.0) -> AsyncIterator[LeasedSandbox]:
        """A box for one rollout; `ttl_s` only reaps a lease whose holder died."""
        ray = sys.modules.get("ray")  # not imported: not initialized either (and this floor stays light)
        if ray is not None and ray.is_initialized():
            from art_ray.sandbox.router import RaySandboxFleet

            key = (self.name, ray.get_runtime_context().get_job_id(), asyncio.get_running_loop())
            if key not in _fleets:  # started once: the handle that made the router must live on, since an
                # actor goes when its maker's references do
                start = RaySandboxFleet.start(
                    self.name, self.slots, self.limits, self.first_uid, self.node_resource
                )
                _fleets[key] = asyncio.ensure_future(start)
            starting = _fleets[key]
            try:
                fleet = await asyncio.shield(starting)
            except Exception:
                if starting.done() and _fleets.get(key) is starting:  # it failed: the next lease tries again
                    _fleets.pop(key)
                raise
            try:
                async with fleet.lease(ttl_s) as remote:
                    yield remote
            except ray.exceptions.RayActorError as error:
                # the router died: the next lease makes another (a host that died is the router's to replace)
                if error.actor_id == fleet.router._actor_id.hex():
                    _fleets.pop(key, None)
                raise
            return
        async with self.lease_here(ttl_s) as box:
            yield box

    async def _local_pool(self) -> SandboxPool:
        key = (self.name, asyncio.get_running_loop())
        if key not in _local_pools:  # a task: leases that come while it starts wait for the same pool
            backend = NamespaceBackend(self.first_uid + LOCAL_UID_OFFSET_HOSTS * self.slots)
            _local_pools[key] = asyncio.create_task(_started(SandboxPool(self.slots, self.limits, backend)))
        return await _local_pools[key]

    def run_blocking(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` (which leases from a pool of this process, Ray or not) from synchronous code, such as a
        TRL reward function, on a private event loop."""
        return asyncio.run_coroutine_threadsafe(work, _blocking_loop()).result()

    @contextlib.asynccontextmanager
    async def lease_here(self, ttl_s: float = 600.0) -> AsyncIterator[LeasedSandbox]:
        """A box from this process's own pool even on Ray (a process that is no rollout runner)."""
        pool = await self._local_pool()
        async with pool.lease(ttl_s) as box:
            yield box


async def _started(pool: SandboxPool) -> SandboxPool:
    await pool.start()
    return pool


_fleets: dict[tuple[str, str, asyncio.AbstractEventLoop], asyncio.Future[Any]] = {}
_local_pools: dict[tuple[str, asyncio.AbstractEventLoop], asyncio.Task[SandboxPool]] = {}
_loop: list[asyncio.AbstractEventLoop] = []
_loop_lock = threading.Lock()


def _blocking_loop() -> asyncio.AbstractEventLoop:
    with _loop_lock:
        if not _loop:
            _loop.append(asyncio.new_event_loop())
            threading.Thread(target=_loop[0].run_forever, daemon=True, name="sandbox-loop").start()
    return _loop[0]
