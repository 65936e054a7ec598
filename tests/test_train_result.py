"""The typed train spine: GradientStep / TrainResult on every seam, and both backends satisfy Backend."""

from __future__ import annotations

import math

from art_ray import Backend, GradientStep, HTTPBackend, RayBackend, TrainResult
from art_ray.remote.protocol import TrainStreamLine


def test_a_result_averages_each_metric_over_the_gradient_steps_that_report_it() -> None:
    steps = [
        GradientStep(metrics={"loss/train": 1.0, "loss/kl": 0.5}),
        GradientStep(metrics={"loss/train": 3.0}),
    ]
    result = TrainResult.of(4, steps, {"time/publish_seconds": 0.1}, checkpoint_path="/runs/c/0004")
    assert result.step == 4 and result.checkpoint_path == "/runs/c/0004"
    assert result.metrics == {"loss/train": 2.0, "loss/kl": 0.5, "time/publish_seconds": 0.1}


def test_the_train_stream_lines_carry_typed_events_and_a_diverged_loss() -> None:
    line = TrainStreamLine(gradient_step=GradientStep(metrics={"loss/train": math.nan}))
    back = TrainStreamLine.model_validate_json(line.model_dump_json(exclude_none=True))
    assert back.result is None and math.isnan(back.gradient_step.metrics["loss/train"])
    final = TrainStreamLine(result=TrainResult(step=2, metrics={"loss/train": 0.3}))
    assert TrainStreamLine.model_validate_json(final.model_dump_json()).result.step == 2


def test_both_backends_implement_the_backend_protocol(tmp_path) -> None:
    assert isinstance(RayBackend(storage=str(tmp_path)), Backend)
    assert isinstance(HTTPBackend("http://127.0.0.1:1"), Backend)
