"""Who calls the Tinker routes: the key's name and limits, as the injected `authorize` judges them."""

from __future__ import annotations

import pydantic

from art_ray.errors import ArtRayError


class UnknownKeyError(ArtRayError, PermissionError):
    """Raised by `authorize` for a missing or unknown API key: answered 401."""


class Principal(pydantic.BaseModel):
    """A caller. `name`: the run key's name, which owns what it creates; None: the admin key, which sees
    everything. `max_concurrent_requests`: its sampling and model-creation requests unfinished at once
    (429 past it); None: no limit."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    max_concurrent_requests: int | None = pydantic.Field(default=None, ge=1)

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see what `owner` (a run key's name; None: the admin key) made."""
        return self.name is None or owner == self.name
