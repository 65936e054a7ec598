"""One training model's requests in the client's order. A TrainingClient numbers them seq_id 1, 2, 3, ...
and sends each after the previous one was acknowledged, except a forward_backward's chunks, which go
together with the first one last (tinker/lib/public_interfaces/training_client.py): each waits its turn."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from art_ray.tinker.types import TinkerUserError

T = TypeVar("T")


class SeqLane:
    """Runs a model's requests one at a time in seq_id order, from `first_seq_id`. `request_ids` maps the
    last `remembered` seq_ids to their request ids, so a request sent again (its reply lost) is answered
    with the original future instead of running twice."""

    def __init__(self, first_seq_id: int = 1, remembered: int = 1024) -> None:
        self.request_ids: dict[int, str] = {}
        self._next_seq_id = first_seq_id
        self._remembered = remembered
        self._running = False
        self._closed_because: str | None = None
        self._turns = asyncio.Condition()

    async def run(self, seq_id: int, work: Callable[[], Awaitable[T]]) -> T:
        """`work()` once every earlier seq_id has run. Raises TinkerUserError for a seq_id already past, and
        once the lane is closed."""
        async with self._turns:
            if seq_id < self._next_seq_id:
                raise TinkerUserError(
                    f"seq_id {seq_id} was already used: this model is at {self._next_seq_id}"
                )
            await self._turns.wait_for(
                lambda: self._closed_because is not None or self._next_seq_id == seq_id
            )
            if self._closed_because is not None:
                raise TinkerUserError(self._closed_because)
            self._running = True
        try:
            return await work()
        finally:
            async with self._turns:
                self._running = False
                self._next_seq_id += 1
                self.request_ids.pop(seq_id - self._remembered, None)
                self._turns.notify_all()

    async def close(self, reason: str) -> None:
        """Fails the requests still waiting (and later ones) with `reason`; returns when none runs."""
        async with self._turns:
            self._closed_because = reason
            self._turns.notify_all()
            await self._turns.wait_for(lambda: not self._running)
