"""What a run's traffic log keeps and hands out, as plain pydantic (no pyarrow, torch or ray): they cross
from the log actor to the driver, and over HTTPBackend's wire.

- `StoredTurn`: a served turn as stored; `TrafficSnapshot`: everything stored, oldest first.
- `MaturedTraffic`: the stored turns whose feedback has come (`LabeledTurn`), in the order their first
  feedback came, past a `TrafficCursor`. A turn is labeled by its first feedback; later feedback on it
  joins the reward until the turn is handed out, and is kept for evaluation after. A turn that no
  feedback reached within `TrafficConfig.mature_after_s` is unlabeled: counted (feedback coverage),
  never trained, never treated as a bad answer. The cursor is the consumer's to keep
  (art_ray/traffic/online.py saves it with each trained step), so each labeled turn is handed out once.
"""

from __future__ import annotations

import statistics

import pydantic

from art_ray.capture.turns import CapturedTurn
from art_ray.feedback import FeedbackRecord


class StoredTurn(pydantic.BaseModel):
    """A served turn as the traffic log keeps it: the CapturedTurn (its completion id, choice with token
    ids, logprobs, sampling parameters and policy version) and the capture session it was part of."""

    turn: CapturedTurn
    session_id: str | None = None

    @property
    def completion_id(self) -> str:
        assert self.turn.completion_id is not None  # the log stores turns with an id only
        return self.turn.completion_id


class TrafficSnapshot(pydantic.BaseModel):
    """A run's stored traffic, oldest first."""

    turns: list[StoredTurn]
    feedback: list[FeedbackRecord]


class TrafficCursor(pydantic.BaseModel):
    """A position in the order of first feedback: (when it came, its feedback id)."""

    received_at: float
    feedback_id: str

    def key(self) -> tuple[float, str]:
        return (self.received_at, self.feedback_id)


class LabeledTurn(pydantic.BaseModel):
    """A stored turn and the feedback it has, oldest first (the first one labeled it)."""

    stored: StoredTurn
    feedback: list[FeedbackRecord] = pydantic.Field(min_length=1)

    @property
    def reward(self) -> float:
        return statistics.fmean(record.score for record in self.feedback)

    @property
    def cursor(self) -> TrafficCursor:
        first = self.feedback[0]
        return TrafficCursor(received_at=first.received_at, feedback_id=first.feedback_id)

    @property
    def delay_s(self) -> float:
        """From serving the turn to its first feedback."""
        return self.feedback[0].received_at - self.stored.turn.created_at


class MaturedTraffic(pydantic.BaseModel):
    """Labeled turns past a cursor (up to a limit, `more` when the limit cut them), and how the run's
    retained turns stand: labeled, unlabeled (past the window with no feedback), still waiting."""

    turns: list[LabeledTurn]
    more: bool = False
    labeled: int = 0
    unlabeled: int = 0
    waiting: int = 0

    @property
    def cursor(self) -> TrafficCursor | None:
        return self.turns[-1].cursor if self.turns else None

    @property
    def coverage(self) -> float | None:
        """The share of matured turns (labeled or past the window) that got feedback."""
        matured = self.labeled + self.unlabeled
        return self.labeled / matured if matured else None
