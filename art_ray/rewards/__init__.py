"""Rewards that need no hand-written scoring function: RULER (an LLM judge ranks a group)."""

from art_ray.rewards.ruler import DEFAULT_RUBRIC, RulerError, TrajectoryScore, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "RulerError", "TrajectoryScore", "ruler", "ruler_score_group"]
