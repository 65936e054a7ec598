"""Admission across sandbox hosts: a `SandboxRouter` actor per job and name keeps one `SandboxHost` on each
node that offers the custom resource `sandbox` (one anywhere when no node does), and hands leases out
first come first served to the host with the most free slots. A lease's commands then go straight to its
host (`RemoteSandbox`); only acquiring and releasing pass through the router.

Nodes that join later (an autoscaler's) get a host at the next lease that finds the list stale; a host that
dies is dropped (its leases fail with SandboxError, its slots leave the count) and made again while its node
lives. Every host's slots run as their own uid range (`first_uid + host index * slots`), so hosts that share
a machine (a simulated cluster) never share uids.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from art_ray.cluster_actors import LONG_LIVED_OPTIONS
from art_ray.errors import SandboxBusy, SandboxError
from art_ray.sandbox.host import RemoteSandbox, SandboxHost
from art_ray.sandbox.types import SandboxLimits

ANYWHERE = "anywhere"  # the host's key when no node offers the sandbox resource
REFRESH_S = 10.0  # how stale the node list may be when a lease comes


@dataclass
class _Host:
    handle: ray.actor.ActorHandle
    free: int


class SandboxRouter:
    """An async actor: the job's hosts and a FIFO line of leases waiting for a slot on any of them."""

    def __init__(
        self,
        slots: int,
        limits: dict,
        first_uid: int,
        node_resource: str = "sandbox",
        max_waiting: int = 1024,
    ) -> None:
        self.slots, self.limits, self.first_uid, self.max_waiting = slots, limits, first_uid, max_waiting
        self.node_resource = node_resource
        self.hosts: dict[str, _Host] = {}
        self.made = 0  # hosts made so far: the next one's uid range
        self.leases: dict[str, tuple[str, str]] = {}  # router lease id -> (node, the host's lease id)
        self.waiters: collections.deque[asyncio.Future[str]] = collections.deque()
        self.refreshed = 0.0
        self.refreshing = asyncio.Lock()

    async def start(self) -> list[str]:
        """Idempotent: the nodes with a host."""
        await self._refresh()
        return sorted(self.hosts)

    async def _refresh(self) -> None:
        async with self.refreshing:
            nodes = [
                node["NodeID"]
                for node in ray.nodes()
                if node["Alive"] and node["Resources"].get(self.node_resource, 0) > 0
            ]
            # hosts are only added here (a dead one was dropped when a call to it failed); a host made
            # anywhere before sandbox nodes came keeps serving beside theirs
            missing = [node for node in nodes or [ANYWHERE] if node not in self.hosts]
            made = await asyncio.gather(*(self._make_host(node) for node in missing), return_exceptions=True)
            for node, host in zip(missing, made, strict=True):
                if not isinstance(host, BaseException):
                    self.hosts[node] = host
            self.refreshed = time.monotonic()
        self._wake()

    async def _make_host(self, node: str) -> _Host:
        first_uid = self.first_uid + self.made * self.slots
        self.made += 1
        placement = (
            {}
            if node == ANYWHERE
            else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        )
        handle = (
            ray.remote(SandboxHost)
            .options(num_cpus=0, max_concurrency=1000, **LONG_LIVED_OPTIONS, **placement)
            .remote(self.slots, self.limits, first_uid, self.max_waiting)
        )
        await handle.start.remote()
        return _Host(handle, self.slots)

    def _take(self) -> str | None:
        """A free slot's node, taken: the host with the most free slots."""
        free = [(host.free, node) for node, host in self.hosts.items() if host.free > 0]
        if not free:
            return None
        node = max(free)[1]
        self.hosts[node].free -= 1
        return node

    def _give_back(self, node: str) -> None:
        if node in self.hosts:
            self.hosts[node].free += 1
        self._wake()

    def _wake(self) -> None:
        """Hand free slots to the waiting leases, oldest first."""
        while self.waiters:
            node = self._take()
            if node is None:
                return
            waiter = self.waiters.popleft()
            if waiter.done():  # its caller went away
                self.hosts[node].free += 1
                continue
            waiter.set_result(node)

    async def acquire(self, ttl_s: float) -> tuple[ray.actor.ActorHandle, str, str]:
        """(host, the host's lease id, the router's lease id) once a slot is free anywhere, in arrival
        order."""
        if not self.hosts or time.monotonic() - self.refreshed > REFRESH_S:
            await self._refresh()
        if not self.hosts:
            raise SandboxError("no sandbox host could start (see the hosts' errors in the Ray logs)")
        node = None if self.waiters else self._take()
        if node is None:
            if len(self.waiters) >= self.max_waiting:
                raise SandboxBusy(f"every sandbox slot is leased and {self.max_waiting} leases wait")
            waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                node = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # a slot came as the caller left
                    self._give_back(waiter.result())
                else:
                    waiter.cancel()
                raise
        host = self.hosts.get(node)
        if host is None:
            raise SandboxError(f"the sandbox host on node {node} died before the lease began")
        try:
            host_lease = await host.handle.acquire.remote(ttl_s)
        except ray.exceptions.RayActorError as error:
            self.hosts.pop(node, None)
            raise SandboxError(f"the sandbox host on node {node} died: {error}") from None
        except BaseException:
            self._give_back(node)
            raise
        lease_id = uuid.uuid4().hex
        self.leases[lease_id] = (node, host_lease)
        # the reaper's count: past its time to live the host took the slot back, whether or not it was
        # released here
        asyncio.get_running_loop().call_later(ttl_s, lambda: asyncio.create_task(self.release(lease_id)))
        return host.handle, host_lease, lease_id

    async def release(self, lease_id: str) -> None:
        leased = self.leases.pop(lease_id, None)
        if leased is None:
            return
        node, host_lease = leased
        host = self.hosts.get(node)
        if host is None:  # its host died: the slot went with it
            return
        try:
            await host.handle.release.remote(host_lease)
        except ray.exceptions.RayActorError:
            self.hosts.pop(node, None)
            return
        self._give_back(node)

    def stats(self) -> dict:
        return {
            "hosts": {node: self.slots - host.free for node, host in self.hosts.items()},
            "leased": len(self.leases),
            "waiting": len(self.waiters),
        }


class RaySandboxFleet:
    """The caller's side of a router: `lease()` as a local pool's."""

    def __init__(self, router: ray.actor.ActorHandle) -> None:
        self.router = router

    @classmethod
    async def start(
        cls,
        name: str,
        slots: int,
        limits: SandboxLimits,
        first_uid: int,
        node_resource: str = "sandbox",
        max_waiting: int = 1024,
    ) -> RaySandboxFleet:
        """The job's router of that `name`, made (with its hosts) by the first caller."""
        router = (
            ray.remote(SandboxRouter)
            .options(num_cpus=0, max_concurrency=1000, name=name, get_if_exists=True, **LONG_LIVED_OPTIONS)
            .remote(slots, limits.model_dump(), first_uid, node_resource, max_waiting)
        )
        await router.start.remote()
        return cls(router)

    @contextlib.asynccontextmanager
    async def lease(self, ttl_s: float = 600.0) -> AsyncIterator[RemoteSandbox]:
        host, host_lease, lease_id = await self.router.acquire.remote(ttl_s)
        try:
            yield RemoteSandbox(host, host_lease)
        finally:
            await self.router.release.remote(lease_id)
