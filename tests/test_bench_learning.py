"""bench/learning.py cannot silently break: its short form runs here (art-ray on the session's SmolLM2
backend, then TRL's GRPOTrainer in its own process), a few seconds of training each, and its figures,
intervals, MLflow curve and plot come out. The bench's own numbers come from `python bench/learning.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import stop_trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

import learning  # noqa: E402


def test_wilson_interval_matches_known_values() -> None:
    low, high = learning.wilson(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    low, high = learning.wilson(0, 8)
    assert low == 0.0 and round(high, 4) == 0.3244
    assert learning.wilson(128, 128)[1] == pytest.approx(1.0)


def test_minutes_to_a_target_is_the_first_evaluation_at_or_above_it() -> None:
    points = [{"minutes": m, "correct": c} for m, c in [(0.0, 0.3), (1.5, 0.6), (3.0, 0.5)]]
    assert learning.first_minutes_at(points, 0.5) == 1.5
    assert learning.first_minutes_at(points, 0.7) is None


def test_the_same_held_out_items_for_every_run() -> None:
    args = learning.parse_args(["--short", "--held-out", "8"])
    first, second = learning.bench_tasks(args)[0], learning.bench_tasks(args)[0]
    assert len(first.val_scenarios) == 8
    assert [p.question for p in first.val_scenarios] == [p.question for p in second.val_scenarios]
    # the example's own 12 held-out problems are the first 12 of the bench's set
    example = sys.modules["code_math_train"].TASK
    assert learning.held_out_items("code_math", 128)[:12] == list(example.val_scenarios)


def test_each_arm_trains_at_its_temperature_and_the_recipe_arm_as_the_example_does() -> None:
    from art_ray import TrainConfig

    recipe = TrainConfig(beta=0.05, precalculate_logprobs=True, train_temperature=1.0)
    args = learning.parse_args(["--short", "--as-if-t1-beta", "0.1"])
    assert args.trained_at == "recipe"
    assert learning.arm_train_config(recipe, None, args) == recipe
    tempered = learning.arm_train_config(recipe, "tempered", args)
    assert (tempered.train_temperature, tempered.beta) == (None, 0.05)
    as_if_one = learning.arm_train_config(TrainConfig(beta=0.05), "one", args)
    assert (as_if_one.train_temperature, as_if_one.precalculate_logprobs, as_if_one.beta) == (1.0, True, 0.1)
    kept = learning.arm_train_config(TrainConfig(beta=0.05), "one", learning.parse_args(["--short"]))
    assert kept.beta == 0.05


@pytest.mark.slow
async def test_the_short_form_trains_both_systems_and_reports_every_figure(smollm2_model, tmp_path) -> None:
    """art-ray on the session's SmolLM2 backend (its engine serves that model), TRL on the tiny model (the
    short form's), then the report: the bench's own `run` is these three calls."""
    import mlflow

    backend = smollm2_model.backend
    plot = tmp_path / "curves.png"
    flags = [
        *("--short", "--minutes", "0.1", "--eval-every", "0.1", "--held-out", "6", "--lora-rank", "8"),
        *("--groups-per-step", "2", "--group-size", "2", "--plot", str(plot)),
    ]
    args = learning.parse_args([*flags, "--model", "smollm2-135m"])
    tasks = learning.bench_tasks(args)
    runs = await learning.art_ray_runs(args, tasks, backend, lambda name: stop_trainer(backend, name))
    runs.append(learning.trl_curve(learning.parse_args(flags), 0, str(tmp_path), tasks[0]))
    result = learning.report(runs, args)

    for prefix in ("code_math", "trl"):
        assert 0.0 <= result[f"{prefix}_base"] <= 1.0 and 0.0 <= result[f"{prefix}_final"] <= 1.0
        assert result[f"{prefix}_lift"] == pytest.approx(result[f"{prefix}_final"] - result[f"{prefix}_base"])
        low, high = result[f"{prefix}_final_ci"]
        assert low <= result[f"{prefix}_final"] <= high
        assert result[f"{prefix}_steps"] >= 1  # the budget bought at least one trained step
    assert {"ratio_to_trl", "minutes_to_trl_final", "trl_best", "ratio_to_trl_best"} <= result.keys()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(plot.with_suffix(".json").read_text())
    assert [run["system"] for run in saved["runs"]] == ["art-ray", "trl"]
    # the held-out curve is in MLflow beside the reward: before training and after the budget
    mlflow.set_tracking_uri(backend.tracking_uri)
    (run,) = mlflow.search_runs(
        experiment_names=["bench-learning"], filter_string="tags.mlflow.runName = 'learning-code-math-0'"
    ).itertuples()
    history = mlflow.MlflowClient().get_metric_history(run.run_id, "val/correct")
    assert len(history) >= 2 and {m.step for m in history} >= {0, result["code_math_steps"]}
