"""What a train call reports, typed: each gradient step as it finishes, then the call's TrainResult.

On the types floor (pydantic only): the trainer group, RayBackend, the training server's stream and the
SDK all speak these, so nothing recognizes the end of a train call by a dict key.
"""

from __future__ import annotations

import statistics

import pydantic


class GradientStep(pydantic.BaseModel):
    """One optimizer step of a train call: loss/*, data/*, throughput/*, time/step_seconds."""

    model_config = pydantic.ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    metrics: dict[str, float]


class TrainResult(pydantic.BaseModel):
    """The end of a train call, as ART 0.5's `TrainResult`/`LocalTrainResult`: the step it made (served by
    every replica when the call returns), the metrics MLflow records at that step (each gradient step's
    metrics averaged, plus time/checkpoint_wait_seconds (waiting for the last step's checkpoint),
    time/publish_enqueue_seconds and time/wait_for_replicas_seconds), and the checkpoint folder
    (written in the background; complete before the next train call starts)."""

    model_config = pydantic.ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    step: int = pydantic.Field(ge=0)
    metrics: dict[str, float] = pydantic.Field(default_factory=dict)
    checkpoint_path: str | None = None

    @classmethod
    def of(
        cls,
        step: int,
        gradient_steps: list[GradientStep],
        timings: dict[str, float],
        checkpoint_path: str | None,
    ) -> TrainResult:
        """The call's result: every gradient-step metric averaged over the steps that report it."""
        names = sorted({name for gradient in gradient_steps for name in gradient.metrics})
        averaged = {
            name: statistics.fmean(g.metrics[name] for g in gradient_steps if name in g.metrics)
            for name in names
        }
        return cls(step=step, metrics={**averaged, **timings}, checkpoint_path=checkpoint_path)


TrainEvent = GradientStep | TrainResult
