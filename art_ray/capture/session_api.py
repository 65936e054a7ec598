"""The bodies of the capture-session routes (art_ray/serving/capture.py): what a client posts to open a
session and what reading or closing one answers. The endpoint validates with these and publishes their
JSON schemas in its OpenAPI document (art_ray/serving/openapi.py).

On the floor: pydantic only.
"""

from __future__ import annotations

import pydantic

from art_ray.capture.turns import CapturedTurn


class OpenSessionRequest(pydantic.BaseModel):
    """`POST /v1/capture/sessions`: the model the session's turns are served by (a run's name, no @step)
    and how long it lives without a turn (the store's default when absent)."""

    model_config = pydantic.ConfigDict(extra="ignore")

    model: pydantic.StrictStr
    ttl_s: pydantic.StrictFloat | pydantic.StrictInt | None = pydantic.Field(default=None, gt=0)


class SessionInfo(pydantic.BaseModel):
    """What opening a session answers: its id (an agent's base URL is `/sessions/{id}/v1`), its model,
    and when it expires (Unix seconds) unless a turn comes first."""

    id: str
    model: str
    expires_at: float


class SessionTurns(pydantic.BaseModel):
    """`GET` (read) or `DELETE` (close, answering the turns it dropped) of `/v1/capture/sessions/{id}`."""

    id: str
    model: str | None
    turns: list[CapturedTurn]
    deleted: bool | None = None
