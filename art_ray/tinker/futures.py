"""The Tinker futures: a work route answers a request id at once, runs the work in the background, and the
SDK long-polls `retrieve_future` for the outcome (tinker/lib/api_future_impl.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic

from art_ray.errors import ArtRayError
from art_ray.tinker.principal import Principal
from art_ray.tinker.types import TinkerUserError

logger = logging.getLogger(__name__)

# A JSON reply, or an encoded protobuf one (SampleResponse, ForwardBackwardOutput).
FutureResult = pydantic.BaseModel | bytes


class FutureFailure(pydantic.BaseModel):
    """A failed request as the SDK reads it: it raises RequestFailedError with this message, no retry."""

    message: str
    category: Literal["user", "server"]


class UnknownFutureError(ArtRayError, LookupError):
    """No such request id, or one another key made (the same answer: 404)."""


@dataclass
class _Future:
    owner: str | None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: FutureResult | FutureFailure | None = None
    expires_at: float = math.inf  # never while the work runs
    task: asyncio.Task[None] | None = None


class FutureTable:
    """Request ids, each bound to the key name that made it. A settled outcome is kept `keep_retrieved_s`
    after it was first read (a poll whose reply was lost is sent again) and `keep_unretrieved_s` if it is
    never read, then dropped."""

    def __init__(
        self,
        *,
        poll_s: float = 30.0,
        keep_retrieved_s: float = 300.0,
        keep_unretrieved_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The SDK polls again at once on try_again and gives up on a poll after 45 s.
        self.poll_s = poll_s
        self.keep_retrieved_s = keep_retrieved_s
        self.keep_unretrieved_s = keep_unretrieved_s
        self._clock = clock
        self._futures: dict[str, _Future] = {}
        self._next_sweep = -math.inf

    def submit(self, owner: str | None, work: Coroutine[Any, Any, FutureResult]) -> str:
        """Starts `work` and answers its request id. A TinkerUserError it raises fails it with category
        user; any other error with category server."""
        self._sweep()
        request_id = uuid.uuid4().hex
        future = self._futures[request_id] = _Future(owner)
        future.task = asyncio.create_task(self._settle(future, work))
        return request_id

    async def _settle(self, future: _Future, work: Coroutine[Any, Any, FutureResult]) -> None:
        try:
            future.outcome = await work
        except TinkerUserError as error:
            future.outcome = FutureFailure(message=str(error), category="user")
        except Exception as error:
            logger.exception("a Tinker request failed")
            future.outcome = FutureFailure(message=f"{type(error).__name__}: {error}", category="server")
        future.expires_at = self._clock() + self.keep_unretrieved_s
        future.settled.set()

    async def retrieve(self, request_id: str, caller: Principal) -> FutureResult | FutureFailure | None:
        """The outcome, waiting up to `poll_s` for it; None if the work still runs. Raises
        UnknownFutureError for an id unknown, dropped, or not the caller's."""
        self._sweep()
        future = self._futures.get(request_id)
        if future is None or not caller.sees(future.owner):
            raise UnknownFutureError(f"no request {request_id!r}: unknown, or its result expired")
        try:
            await asyncio.wait_for(future.settled.wait(), self.poll_s)
        except TimeoutError:
            return None
        future.expires_at = min(future.expires_at, self._clock() + self.keep_retrieved_s)
        return future.outcome

    def _sweep(self) -> None:
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(self.keep_retrieved_s, 10.0)
        for request_id in [rid for rid, future in self._futures.items() if future.expires_at <= now]:
            del self._futures[request_id]
