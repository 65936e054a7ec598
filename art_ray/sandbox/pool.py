"""A pool of warm sandbox slots leased one rollout at a time, in this process (asyncio, no Ray): FIFO
admission with a bounded waiting line, a time to live per lease, a reset between leases and the
replacement of a slot that broke. A Ray host actor per node wraps one such pool (its next increment).

    async with SandboxPool(slots=8, limits=SandboxLimits(wall_s=5)) as pool:
        async with pool.lease(ttl_s=600) as box:
            result = await box.run("echo hi")
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator

from art_ray.errors import LeaseExpired, SandboxBusy, SandboxError
from art_ray.sandbox.backend import SandboxBackend, SandboxSlot
from art_ray.sandbox.types import ExecResult, SandboxLimits


class Sandbox:
    """A leased slot. Valid inside its `lease` block, until its time to live runs out."""

    def __init__(self, slot: SandboxSlot, limits: SandboxLimits) -> None:
        self.slot, self.limits = slot, limits
        self.expired = self.released = False
        self.expiry: asyncio.TimerHandle | None = None

    def _live(self) -> SandboxSlot:
        if self.expired:
            raise LeaseExpired(f"the lease of slot {self.slot.index} ran out")
        return self.slot

    def _expire(self) -> None:
        self.expired = True
        self.slot.kill()

    async def _guarded(
        self, call
    ):  # a slot killed by the time to live answers LeaseExpired, not a broken pipe
        try:
            return await call
        except SandboxError as error:
            if self.expired:
                raise LeaseExpired(f"the lease of slot {self.slot.index} ran out") from error
            raise

    async def run(self, command: str, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """`bash -c command` in /workspace."""
        return await self._guarded(self._live().run(command, timeout_s or self.limits.wall_s, stdin))

    async def python(self, code: str, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """`code` as main.py's source, forked from a warm interpreter (the pool's venv packages import)."""
        return await self._guarded(self._live().python(code, timeout_s or self.limits.wall_s, stdin))

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Relative paths are under /workspace; parents are made."""
        payload = data.encode() if isinstance(data, str) else data
        await self._guarded(self._live().write_file(path, payload))

    async def read_file(self, path: str) -> bytes:
        return await self._guarded(self._live().read_file(path))

    async def list_dir(self, path: str = ".") -> list[str]:
        return await self._guarded(self._live().list_dir(path))

    async def reset(self) -> None:
        """Kill every process and empty /workspace and /tmp; the lease goes on."""
        await self._guarded(self._live().reset())


class SandboxPool:
    """`slots` warm sandboxes from `backend` (default: NamespaceBackend). At most `max_waiting` leases wait
    for a slot; one more raises SandboxBusy at once."""

    def __init__(
        self,
        slots: int = 8,
        limits: SandboxLimits | None = None,
        backend: SandboxBackend | None = None,
        max_waiting: int = 1024,
    ) -> None:
        if backend is None:
            from art_ray.sandbox.namespaces import NamespaceBackend

            backend = NamespaceBackend()
        self.slots, self.limits, self.backend, self.max_waiting = (
            slots,
            limits or SandboxLimits(),
            backend,
            max_waiting,
        )
        self.idle: collections.deque[SandboxSlot] = collections.deque()
        self.waiters: collections.deque[asyncio.Future[SandboxSlot]] = collections.deque()
        self.replacing: set[asyncio.Task] = set()
        self.started_s: float | None = None
        self.replaced = 0
        self.closed = False

    async def start(self) -> None:
        began = time.perf_counter()
        started = await asyncio.gather(
            *(self.backend.start_slot(index, self.limits) for index in range(self.slots)),
            return_exceptions=True,
        )
        failures = [result for result in started if isinstance(result, BaseException)]
        if failures:
            await asyncio.gather(*(slot.close() for slot in started if not isinstance(slot, BaseException)))
            raise SandboxError(f"{len(failures)} of {self.slots} slots did not start") from failures[0]
        self.idle.extend(started)
        self.started_s = time.perf_counter() - began

    async def close(self) -> None:
        self.closed = True
        for task in self.replacing:
            task.cancel()
        await asyncio.gather(*self.replacing, return_exceptions=True)
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_exception(SandboxError("the pool closed"))
        while self.idle:
            await self.idle.popleft().close()

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def waiting(self) -> int:
        return sum(not waiter.done() for waiter in self.waiters)

    async def _wait_for_slot(self) -> SandboxSlot:
        if self.closed:
            raise SandboxError("the pool is closed")
        if self.idle and not self.waiting:
            return self.idle.popleft()
        if self.waiting >= self.max_waiting:
            raise SandboxBusy(f"all {self.slots} slots leased and {self.waiting} leases waiting")
        waiter: asyncio.Future[SandboxSlot] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._hand_over(waiter.result())  # handed a slot as it was cancelled: the next one gets it
            raise

    def _hand_over(self, slot: SandboxSlot) -> None:
        """A clean slot goes to the longest waiter (FIFO), else back to the idle ones."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self.idle.append(slot)

    async def _release(self, slot: SandboxSlot) -> None:
        if slot.alive and not self.closed:
            try:
                await slot.reset()
                self._hand_over(slot)
                return
            except SandboxError:
                pass
        await slot.close()
        if not self.closed:
            task = asyncio.create_task(self._replace(slot.index))
            self.replacing.add(task)
            task.add_done_callback(self.replacing.discard)

    async def _replace(self, index: int) -> None:
        """A new slot in a broken one's place (same index, so the same uid); retried until it starts."""
        while not self.closed:
            try:
                slot = await self.backend.start_slot(index, self.limits)
            except SandboxError:
                await asyncio.sleep(1.0)
                continue
            self.replaced += 1
            self._hand_over(slot)
            return

    async def acquire(self, ttl_s: float | None = None) -> Sandbox:
        """The first half of `lease`, for a holder that cannot keep an `async with` open across its calls
        (a Ray actor serving a lease call by call): each acquire needs its `release`."""
        box = Sandbox(await self._wait_for_slot(), self.limits)
        if ttl_s:
            box.expiry = asyncio.get_running_loop().call_later(ttl_s, box._expire)
        return box

    async def release(self, box: Sandbox) -> None:
        if box.released:
            return
        box.released = True
        if box.expiry is not None:
            box.expiry.cancel()
        await self._release(box.slot)

    @contextlib.asynccontextmanager
    async def lease(self, ttl_s: float | None = None) -> AsyncIterator[Sandbox]:
        """A sandbox for one rollout; waits its turn (FIFO). After `ttl_s` its processes are killed and its
        calls raise LeaseExpired. On exit it is reset (or replaced) for the next lease."""
        box = await self.acquire(ttl_s)
        try:
            yield box
        finally:
            await self.release(box)
