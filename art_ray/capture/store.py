"""The capture store: a named Ray actor holding every open capture session's recorded turns.

One per cluster, created with the inference app (`ensure_capture_store`): the replica that served a turn
appends it here before the client gets its last byte, so a turn follows the request wherever Serve routed
it, and a replica that dies afterwards loses nothing it had answered. A session is bound to the API key
that opened it (its SHA-256) and to one model name; a lookup with another key answers as if the session
did not exist. A client may also name a session itself (a random id of 16-64 URL-safe characters): the
store opens it, bound to that request's key and model, with the first completion recorded in it, so a
rollout needs no round trip before its agent runs. An id that was closed or expired stays refused for a
TTL afterwards, so a late turn never starts a second session under it. Sessions expire `ttl_s` after
their last use, and the store refuses new turns once its recorded bytes reach `max_bytes` (the client
gets a 429 before anything is generated). A store that dies loses its sessions: reading one then raises
"not found", never a partial trajectory.
"""

from __future__ import annotations

import secrets
import time

import pydantic
import ray

from art_ray.capture.session_api import SessionInfo
from art_ray.capture.turns import CapturedTurn
from art_ray.cluster_actors import ensure_cluster_actor, get_cluster_actor

CAPTURE_STORE_NAME = "art_ray_capture_store"


class CaptureRefused(pydantic.BaseModel):
    """Why a session request was refused, as the endpoint answers it (OpenAI error JSON)."""

    status: int
    message: str


class _Session:
    def __init__(self, model: str, key_digest: str, ttl_s: float) -> None:
        self.model = model
        self.key_digest = key_digest
        self.ttl_s = ttl_s
        self.expires_at = time.time() + ttl_s
        self.turns: list[CapturedTurn] = []
        self.nbytes = 0

    def touch(self) -> None:
        self.expires_at = time.time() + self.ttl_s


@ray.remote(num_cpus=0, max_concurrency=64)
class CaptureStore:
    def __init__(self, max_bytes: int, default_ttl_s: float) -> None:
        self._max_bytes = max_bytes
        self._default_ttl_s = default_ttl_s
        self._sessions: dict[str, _Session] = {}
        self._ended: dict[str, float] = {}  # id -> when it was closed or expired
        self._nbytes = 0

    def open(self, model: str, key_digest: str, ttl_s: float | None = None) -> SessionInfo:
        self._expire()
        session_id = secrets.token_urlsafe(16)
        session = _Session(model, key_digest, ttl_s or self._default_ttl_s)
        self._sessions[session_id] = session
        return SessionInfo(id=session_id, model=model, expires_at=session.expires_at)

    def admit(self, session_id: str, key_digest: str, model: str) -> CaptureRefused | None:
        """Whether a completion for `model` may be recorded in the session (asked before generating). A
        session id never seen before is opened here, bound to this key and model."""
        self._expire()
        if session_id not in self._sessions and session_id not in self._ended:
            self._sessions[session_id] = _Session(model, key_digest, self._default_ttl_s)
        session = self._owned(session_id, key_digest)
        if session is None:
            return CaptureRefused(status=404, message=f"capture session {session_id!r} not found or expired")
        if model != session.model:
            return CaptureRefused(
                status=400,
                message=f"capture session {session_id!r} records model {session.model!r}, not {model!r}",
            )
        if self._nbytes >= self._max_bytes:
            return CaptureRefused(
                status=429,
                message=f"the capture store holds {self._nbytes} bytes (cap {self._max_bytes}): read or "
                "close finished sessions",
            )
        return None

    def append(self, session_id: str, key_digest: str, turn: CapturedTurn) -> bool:
        session = self._owned(session_id, key_digest)
        if session is None:
            return False
        nbytes = len(turn.model_dump_json())
        session.turns.append(turn)
        session.nbytes += nbytes
        self._nbytes += nbytes
        session.touch()
        return True

    def read(self, session_id: str, key_digest: str, model: str) -> list[CapturedTurn] | None:
        """The session's turns so far (None: no such session for this key and model)."""
        self._expire()
        session = self._owned(session_id, key_digest)
        if session is None or session.model != model:
            return None
        session.touch()
        return list(session.turns)

    def close(self, session_id: str, key_digest: str, model: str | None = None) -> list[CapturedTurn] | None:
        """Drop the session; its turns (None: no such session for this key, and `model` when given)."""
        session = self._owned(session_id, key_digest)
        if session is None or model not in (None, session.model):
            return None
        self._drop(session_id)
        return session.turns

    def stats(self) -> dict[str, int]:
        self._expire()
        return {"sessions": len(self._sessions), "bytes": self._nbytes}

    def _owned(self, session_id: str, key_digest: str) -> _Session | None:
        session = self._sessions.get(session_id)
        if session is None or not secrets.compare_digest(session.key_digest, key_digest):
            return None
        return session

    def _expire(self) -> None:
        now = time.time()
        for session_id in [sid for sid, s in self._sessions.items() if s.expires_at < now]:
            self._drop(session_id)
        for session_id in [sid for sid, ended in self._ended.items() if ended < now - self._default_ttl_s]:
            del self._ended[session_id]

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id)
        self._nbytes -= session.nbytes
        self._ended[session_id] = time.time()


def ensure_capture_store(max_bytes: int, default_ttl_s: float) -> ray.actor.ActorHandle:
    """The cluster's capture store, created unless it runs (detached, like the LoRA registry)."""
    return ensure_cluster_actor(CaptureStore, CAPTURE_STORE_NAME, max_bytes, default_ttl_s)


def get_capture_store() -> ray.actor.ActorHandle:
    return get_cluster_actor(CAPTURE_STORE_NAME)
