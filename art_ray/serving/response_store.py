"""Stored responses, so a Responses API client can continue with `previous_response_id`.

Each stored response keeps the input items its request added and the output items it answered, the id it
continued, and the key that asked for it (its SHA-256, as capture binds sessions). A request naming a
`previous_response_id` is answered over the whole chain's items, oldest first, followed by its own input:
the chat turn the engine sees, and capture records, extends the previous one, so a chain is one
conversation in a trajectory. Instructions are not carried over, as in OpenAI's API: they are each
request's own.

One store per cluster, a named detached actor created by the first replica that stores a response (a
deployment whose agents never speak Responses runs no extra process). It keeps the most recently used
responses up to `max_bytes` of items and forgets the least recently used beyond; a response it forgot, or
one asked for with another key, is "not found" (404), and so is one asked for after the store restarted.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
from typing import Any

import pydantic
import ray

from art_ray.cluster_actors import ensure_cluster_actor

logger = logging.getLogger(__name__)

RESPONSE_STORE_NAME = "art_ray_response_store"


class StoredResponse(pydantic.BaseModel):
    owner: str  # the SHA-256 of the key that asked for it ("" on an endpoint without a key)
    previous_id: str | None
    items: list[dict[str, Any]]  # the request's own input items, then the response's output items
    nbytes: int


class StoredResponses:
    """The store's state (the actor is this class under `ray.remote`)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._responses: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._nbytes = 0

    def put(self, response_id: str, owner: str, previous_id: str | None, items: list[dict[str, Any]]) -> bool:
        """Keep a response; False when its items alone exceed the store's bytes."""
        nbytes = len(json.dumps(items))
        if nbytes > self._max_bytes:
            return False
        self._drop(response_id)
        self._responses[response_id] = StoredResponse(
            owner=owner, previous_id=previous_id, items=items, nbytes=nbytes
        )
        self._nbytes += nbytes
        while self._nbytes > self._max_bytes:
            self._drop(next(iter(self._responses)))
        return True

    def conversation(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """Every item of the chain that ends at `response_id`, oldest first; None when any response of it is
        not stored or not `owner`'s."""
        segments: list[list[dict[str, Any]]] = []
        seen: set[str] = set()
        current: str | None = response_id
        while current is not None and current not in seen:
            stored = self._responses.get(current)
            if stored is None or not secrets.compare_digest(stored.owner, owner):
                return None
            self._responses.move_to_end(current)
            segments.append(stored.items)
            seen.add(current)
            current = stored.previous_id
        return [item for segment in reversed(segments) for item in segment]

    def stats(self) -> dict[str, int]:
        return {"responses": len(self._responses), "bytes": self._nbytes}

    def _drop(self, response_id: str) -> None:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self._nbytes -= stored.nbytes


ResponseStore = ray.remote(num_cpus=0, max_concurrency=1)(StoredResponses)


def ensure_response_store(max_bytes: int) -> ray.actor.ActorHandle:
    """The cluster's response store, created unless it runs (the first creator's `max_bytes` wins)."""
    return ensure_cluster_actor(ResponseStore, RESPONSE_STORE_NAME, max_bytes)


class ClusterResponseHistory:
    """A replica's view of the cluster's response store (ResponsesBridge's `ResponseHistory`): the actor is
    looked up, or created, on first use."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._store: ray.actor.ActorHandle | None = None

    async def _handle(self) -> ray.actor.ActorHandle:
        if self._store is None:  # a GCS round trip: off the replica's event loop
            self._store = await asyncio.to_thread(ensure_response_store, self._max_bytes)
        return self._store

    async def put(
        self, response_id: str, owner: str, previous_id: str | None, items: list[dict[str, Any]]
    ) -> None:
        try:
            kept = await (await self._handle()).put.remote(response_id, owner, previous_id, items)
        except ray.exceptions.RayError as error:  # the client still gets its answer; only a chain breaks
            logger.warning("response %s not stored: %s", response_id, error)
            return
        if not kept:
            logger.warning(
                "response %s not stored: its items exceed the store's %d bytes", response_id, self._max_bytes
            )

    async def conversation(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        return await (await self._handle()).conversation.remote(response_id, owner)
