"""Who may see what on a shared deployment: API keys with a name and limits, and which key's name owns
each run.

The backend's own key (`RayBackend(api_key=...)`, the endpoint's and training server's key) is the admin
key: it sees every run. Keys made with `create_key` are run keys: one sees the runs its name owns
(`ModelConfig.owner`), their capture sessions, stored responses and checkpoints, and nothing else: every
other run is answered as if it did not exist (404). A run with no owner is seen by the admin key only.

The table lives in the cluster's LoRA registry (art_ray/adapters/registry.py), which pushes each change
to every inference replica; only SHA-256 digests of keys are kept anywhere. This module imports no Ray.
"""

from __future__ import annotations

import hashlib
import secrets

import pydantic

from art_ray.adapters.spec import validate_model_name
from art_ray.errors import ArtRayError
from art_ray.releases import Release

KEY_PREFIX = "art-"


class AccessError(ArtRayError, ValueError):
    """A key operation that cannot be done: a name taken, an unknown key name."""


class KeyGrant(pydantic.BaseModel):
    """What one run key may do. `max_concurrent_requests`: requests in flight at once on each inference
    replica and on the training server (429 past it); `max_train_tokens`: tokens in one train call (413
    past it). None: no limit. `store_traffic`: whether the completions this key asks for are stored for
    training by runs that store their traffic (ModelConfig.traffic); False: never, as if each request
    said `"store": false` (a tenant that did not consent)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str
    max_concurrent_requests: int | None = pydantic.Field(default=None, ge=1)
    max_train_tokens: int | None = pydantic.Field(default=None, ge=1)
    store_traffic: bool = True

    @pydantic.field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return validate_model_name(value)


def key_digest(key: str) -> str:
    """SHA-256 of the key's bytes (a header's bytes come back exactly: asgi.presented_key decodes them
    with surrogateescape)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key(prefix: str = KEY_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)


class AccessTable(pydantic.BaseModel):
    """Run keys (by digest) and run owners; `version` grows with each change, so a replica that hears
    of two changes out of order keeps the newer table."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    version: int = 0
    keys: dict[str, KeyGrant] = pydantic.Field(default_factory=dict)
    owners: dict[str, str] = pydantic.Field(default_factory=dict)
    # the runs whose served turns are stored for training (ModelConfig.traffic; art_ray/traffic/log.py)
    traffic: frozenset[str] = frozenset()
    # each released run's arms (art_ray/releases.py): which step a request for its bare name gets
    releases: dict[str, Release] = pydantic.Field(default_factory=dict)

    def grant_for(self, key: str | None) -> KeyGrant | None:
        """The run key's grant, or None when `key` is no run key (it may still be the admin key)."""
        if not key or not self.keys:
            return None
        return self.keys.get(key_digest(key))

    def grant_named(self, name: str) -> KeyGrant | None:
        return next((grant for grant in self.keys.values() if grant.name == name), None)

    def sees(self, grant: KeyGrant | None, model: str) -> bool:
        """Whether a caller with `grant` (None: the admin key) may see the run `model`."""
        return grant is None or self.owners.get(model) == grant.name

    def with_key(self, digest: str, grant: KeyGrant) -> AccessTable:
        """The table with a run key added, by the SHA-256 digest of the key (`key_digest`)."""
        if self.grant_named(grant.name) is not None:
            raise AccessError(f"a key named {grant.name!r} exists: revoke it first or choose another name")
        if digest in self.keys:
            raise AccessError("that key is already in use: draw a new one")
        return self._changed(keys={**self.keys, digest: grant})

    def without_key(self, name: str) -> AccessTable:
        if self.grant_named(name) is None:
            raise AccessError(f"no key is named {name!r}")
        return self._changed(keys={d: g for d, g in self.keys.items() if g.name != name})

    def with_owner(self, model: str, owner: str | None) -> AccessTable:
        owners = {m: o for m, o in self.owners.items() if m != model}
        if owner is not None:
            owners[model] = owner
        return self._changed(owners=owners)

    def with_traffic(self, model: str, stored: bool) -> AccessTable:
        return self._changed(traffic=self.traffic | {model} if stored else self.traffic - {model})

    def with_release(self, model: str, release: Release | None) -> AccessTable:
        releases = {name: r for name, r in self.releases.items() if name != model}
        if release is not None:
            releases[model] = release
        return self._changed(releases=releases)

    def _changed(self, **fields: object) -> AccessTable:
        return self.model_copy(update={**fields, "version": self.version + 1})
