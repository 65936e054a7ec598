"""Run keys on the connected cluster (art_ray/access.py): made, revoked and listed in the LoRA registry,
which every inference replica hears from at once. RayBackend's key methods and `art-ray keys` call these."""

from __future__ import annotations

from typing import Any

import ray

from art_ray.access import KEY_PREFIX, AccessError, AccessTable, KeyGrant, key_digest, new_key
from art_ray.adapters.registry import ensure_registry


async def _unwrapped(call: Any) -> Any:
    """The registry's answer; its AccessError as the SDK's own exception, not Ray's wrapper of it."""
    try:
        return await call
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, AccessError):
            raise AccessError(str(error.cause)) from None
        raise


async def create_key(grant: KeyGrant, key: str | None = None, prefix: str = KEY_PREFIX) -> str:
    """A run key with `grant`'s name and limits: it sees the runs whose `ModelConfig.owner` is that name on
    the endpoint and the training server, and nothing else. Returns the key (drawn at random unless given;
    only its digest is kept). AccessError when the name or the key is taken."""
    key = key or new_key(prefix)
    await _unwrapped(ensure_registry().add_key.remote(key_digest(key), grant))
    return key


async def revoke_key(name: str) -> None:
    """The key named `name` is refused everywhere when this returns; its runs stay (a new key of that name
    sees them)."""
    await _unwrapped(ensure_registry().revoke_key.remote(name))


async def access_table() -> AccessTable:
    """The cluster's run keys (names and limits, never the keys) and run owners."""
    return await ensure_registry().access.remote()
