"""Sandboxes on Ray: a `SandboxHost` async actor per node owns a SandboxPool and serves leases call by call;
`RaySandboxPool` is the caller's side. A lease's time to live is also its reaper: when it runs out the host
kills the lease's processes and takes the slot back, so a driver killed mid-rollout leaks nothing past it.

    pool = await RaySandboxPool.start(slots=8, limits=SandboxLimits(wall_s=5))  # a {"sandbox": 1} node
    async with pool.lease(ttl_s=600) as box:
        result = await box.run("echo hi")

Placement: the host asks for the custom resource `{"sandbox": 1}` (give it to CPU nodes meant for
sandboxes: `ray start --resources='{"sandbox": 1}'`) and no CPU; `resources={}` puts it anywhere, the head
node included, which only a user who allows that should ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import ray

from art_ray.cluster_actors import LONG_LIVED_OPTIONS
from art_ray.errors import SandboxError
from art_ray.sandbox.namespaces import NamespaceBackend
from art_ray.sandbox.pool import Sandbox, SandboxPool
from art_ray.sandbox.types import ExecResult, SandboxLimits


class SandboxHost:
    """One node's pool. Calls of many leases overlap (an async actor); each lease's calls go to its slot."""

    def __init__(self, slots: int, limits: dict, first_uid: int = 100000, max_waiting: int = 1024) -> None:
        backend = NamespaceBackend(first_uid)
        self.pool = SandboxPool(slots, SandboxLimits.model_validate(limits), backend, max_waiting)
        self.leases: dict[str, Sandbox] = {}

    async def start(self) -> float:
        await self.pool.start()
        return self.pool.started_s

    async def acquire(self, ttl_s: float) -> str:
        box = await self.pool.acquire(ttl_s)
        lease_id = uuid.uuid4().hex
        self.leases[lease_id] = box
        # the reaper: past its time to live a lease is taken back whether or not its holder still lives
        asyncio.get_running_loop().call_later(ttl_s, lambda: asyncio.create_task(self.release(lease_id)))
        return lease_id

    async def release(self, lease_id: str) -> None:
        box = self.leases.pop(lease_id, None)
        if box is not None:
            await self.pool.release(box)

    def box(self, lease_id: str) -> Sandbox:
        if lease_id not in self.leases:
            raise SandboxError(f"no lease {lease_id} here: released, or reaped past its time to live")
        return self.leases[lease_id]

    async def run(self, lease_id: str, command: str, timeout_s: float | None, stdin: str | None) -> dict:
        return (await self.box(lease_id).run(command, timeout_s, stdin)).model_dump()

    async def python(self, lease_id: str, code: str, timeout_s: float | None, stdin: str | None) -> dict:
        return (await self.box(lease_id).python(code, timeout_s, stdin)).model_dump()

    async def write_file(self, lease_id: str, path: str, data: bytes) -> None:
        await self.box(lease_id).write_file(path, data)

    async def read_file(self, lease_id: str, path: str) -> bytes:
        return await self.box(lease_id).read_file(path)

    async def list_dir(self, lease_id: str, path: str) -> list[str]:
        return await self.box(lease_id).list_dir(path)

    async def reset(self, lease_id: str) -> None:
        await self.box(lease_id).reset()

    def node_id(self) -> str:
        """The Ray node this host runs on (its slots run there too)."""
        return ray.get_runtime_context().get_node_id()

    async def stats(self) -> dict:
        return {"leased": len(self.leases), "waiting": self.pool.waiting, "replaced": self.pool.replaced}

    async def close(self) -> None:
        await self.pool.close()


class RemoteSandbox:
    """A lease on a SandboxHost, with the calls of a local `Sandbox`; errors arrive as the host raised them
    (SandboxError, LeaseExpired, SandboxFileError)."""

    def __init__(self, host: ray.actor.ActorHandle, lease_id: str) -> None:
        self.host, self.lease_id = host, lease_id

    async def run(self, command: str, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        return ExecResult.model_validate(await self.host.run.remote(self.lease_id, command, timeout_s, stdin))

    async def python(self, code: str, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        return ExecResult.model_validate(await self.host.python.remote(self.lease_id, code, timeout_s, stdin))

    async def write_file(self, path: str, data: str | bytes) -> None:
        payload = data.encode() if isinstance(data, str) else data
        await self.host.write_file.remote(self.lease_id, path, payload)

    async def read_file(self, path: str) -> bytes:
        return await self.host.read_file.remote(self.lease_id, path)

    async def list_dir(self, path: str = ".") -> list[str]:
        return await self.host.list_dir.remote(self.lease_id, path)

    async def reset(self) -> None:
        await self.host.reset.remote(self.lease_id)


class RaySandboxPool:
    def __init__(self, host: ray.actor.ActorHandle) -> None:
        self.host = host

    @classmethod
    async def start(
        cls,
        slots: int = 8,
        limits: SandboxLimits | None = None,
        resources: dict[str, float] | None = None,
        first_uid: int = 100000,
    ) -> RaySandboxPool:
        """A host actor with `slots` warm slots, on a node with `resources` (default `{"sandbox": 1}`).
        A job's rollouts share hosts through SharedSandboxes (router.py) instead."""
        actor = ray.remote(SandboxHost).options(
            num_cpus=0,
            resources={"sandbox": 1} if resources is None else resources,
            max_concurrency=1000,  # leases wait inside the pool's FIFO, not in Ray's queue
            **LONG_LIVED_OPTIONS,
        )
        host = actor.remote(slots, (limits or SandboxLimits()).model_dump(), first_uid)
        await host.start.remote()
        return cls(host)

    @contextlib.asynccontextmanager
    async def lease(self, ttl_s: float = 600.0) -> AsyncIterator[RemoteSandbox]:
        lease_id = await self.host.acquire.remote(ttl_s)
        try:
            yield RemoteSandbox(self.host, lease_id)
        finally:
            await self.host.release.remote(lease_id)

    async def close(self) -> None:
        await self.host.close.remote()
        ray.kill(self.host)
