"""Traffic capture and feedback: what a deployed run keeps of its own traffic, and the scores that reach
its turns later (a user's thumbs, a judge, a system signal).

A run opts in with `ModelConfig.traffic` (`TrafficConfig`); each completion the endpoint serves for it
is then stored with its completion id, sampling parameters and policy version, unless the request says
`"store": false`, as OpenAI's API does. Feedback names a stored turn by its completion id (or the
capture session that recorded it) and carries a score; it is idempotent by `feedback_id`. Plain pydantic:
no torch, ray or openai, since it crosses processes (client -> endpoint -> the run's traffic log).
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Literal

import pydantic

FeedbackSource = Literal["user", "judge", "system"]

# a feedback id is the client's (16-128 URL-safe characters), else drawn by the server
FEEDBACK_ID = r"[A-Za-z0-9_-]{16,128}"
# a completion id as vLLM and OpenAI write them (chatcmpl-..., cmpl-...), bounded
COMPLETION_ID = r"[A-Za-z0-9_.:-]{1,256}"


class TrafficConfig(pydantic.BaseModel):
    """A run's traffic capture. `retention_s`: stored turns and their feedback are deleted this long after
    the turn (feedback for an older turn is answered 404); `flush_turns`/`flush_s`: the log writes a
    Parquet file of its newest turns after this many turns or seconds, whichever comes first (until then
    they sit in an append-only segment file beside it, which a restarted log reads back);
    `mature_after_s`: a turn with no feedback this long after it was served is unlabeled, counted in the
    feedback coverage and never trained as if it were bad (a turn with feedback is trainable at once);
    `early_feedback_s`: feedback posted with a response's token before its turn is stored (a stream
    still being sent) waits this long for it."""

    model_config = pydantic.ConfigDict(extra="forbid")

    retention_s: float = pydantic.Field(default=7 * 86400.0, gt=0)
    flush_turns: int = pydantic.Field(default=256, ge=1)
    flush_s: float = pydantic.Field(default=60.0, gt=0)
    mature_after_s: float = pydantic.Field(default=3600.0, gt=0)
    early_feedback_s: float = pydantic.Field(default=600.0, gt=0)


class Feedback(pydantic.BaseModel):
    """A score for one served turn, as a client posts it to `/v1/feedback`. Names the turn by
    `completion_id` (the response's `id`: a chat or text completion's, or a Responses API `resp_` id)
    or `session_id` (a capture session: its last turn); `token`: the `X-Art-Ray-Feedback-Token` of the
    response, which authorizes the post without an API key."""

    model_config = pydantic.ConfigDict(extra="forbid")

    completion_id: str | None = pydantic.Field(default=None, pattern=f"^{COMPLETION_ID}$")
    session_id: str | None = pydantic.Field(default=None, pattern=r"^[A-Za-z0-9_-]{16,64}$")
    model: str | None = pydantic.Field(default=None, max_length=256)
    score: float
    comment: str | None = pydantic.Field(default=None, max_length=4096)
    source: FeedbackSource = "user"
    feedback_id: str | None = pydantic.Field(default=None, pattern=f"^{FEEDBACK_ID}$")
    token: str | None = pydantic.Field(default=None, max_length=1024)

    @pydantic.field_validator("completion_id")
    @classmethod
    def _chat_id(cls, value: str | None) -> str | None:
        # a Responses API id names the chat completion the endpoint served it as (resp_X: chatcmpl-X)
        return chat_completion_id(value) if value is not None else None

    @pydantic.field_validator("score")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("score must be a finite number")
        return value

    @pydantic.model_validator(mode="after")
    def _one_target(self) -> Feedback:
        if (self.completion_id is None) == (self.session_id is None) and self.token is None:
            raise ValueError(
                "name the turn by exactly one of completion_id and session_id (or send its token)"
            )
        return self


class FeedbackRecord(pydantic.BaseModel):
    """Feedback as the run's traffic log stores it: the turn it joined, when it came, and its id."""

    feedback_id: str
    completion_id: str
    model: str
    score: float
    comment: str | None = None
    source: FeedbackSource = "user"
    received_at: float


# OpenAI's limits on a request's `metadata`
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def request_metadata(payload: dict) -> dict[str, str] | None:
    """A request's `metadata` as OpenAI's API takes it (up to 16 string pairs, keys up to 64 characters,
    values up to 512); ValueError says what is wrong. A stored turn keeps it, and its `task` groups it."""
    metadata = payload.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise ValueError("`metadata` is an object of string keys and string values")
    if len(metadata) > METADATA_PAIRS:
        raise ValueError(f"`metadata` holds at most {METADATA_PAIRS} pairs, not {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise ValueError(
                f"`metadata` keys hold at most {METADATA_KEY_CHARS} characters and values "
                f"{METADATA_VALUE_CHARS} ({key[:80]!r})"
            )
    return dict(metadata)


def chat_completion_id(completion_id: str) -> str:
    """The id a turn is stored under: a Responses API `resp_X` was served as the chat completion
    `chatcmpl-X` (art_ray/serving/responses_bridge.py); other ids are their own."""
    return (
        "chatcmpl-" + completion_id.removeprefix("resp_")
        if completion_id.startswith("resp_")
        else completion_id
    )


def new_feedback_id() -> str:
    return "fb-" + secrets.token_urlsafe(16)


def is_completion_id(value: str) -> bool:
    return re.fullmatch(COMPLETION_ID, value) is not None
