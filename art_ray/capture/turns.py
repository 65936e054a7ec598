"""One recorded completion of a capture session, as the replica stores it and the assembler reads it.

Plain pydantic over JSON-shaped dicts: it crosses processes (replica -> store actor -> driver) and must
import without torch, ray or openai, so a driver that only assembles trajectories stays on the SDK floor.
"""

from __future__ import annotations

from typing import Any

import pydantic


class CapturedTurn(pydantic.BaseModel):
    """A chat completion the endpoint served inside a capture session.

    `choice` is the choice as the client received it after art-ray's middleware: OpenAI's
    `ChatCompletion.choices[i]` shape (`index`, `message`, `finish_reason`, `logprobs`) plus the extra keys
    `token_ids`, `prompt_token_ids`, `policy_version` and `sampling_params` (what it was sampled with:
    art_ray/sampling.py; a streamed turn's come from its request, with `max_tokens` only where it set one).
    `completion_id`: the response's `id` (`chatcmpl-...`, `cmpl-...`), by which feedback can name the turn.
    `metadata`: the request's OpenAI `metadata` (string pairs); its `task` names the task a stored turn
    is grouped under for training (art_ray/traffic/groups.py).
    """

    request_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    choice: dict[str, Any]
    model: str
    created_at: float
    completion_id: str | None = None
    metadata: dict[str, str] | None = None
