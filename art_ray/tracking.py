"""Metrics to MLflow (experiment = project, run = model name, resumed after a restart) and
trajectories to Parquet under the model's folder."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from art_ray import storage
from art_ray.parquet import read_trajectory_groups, write_trajectory_groups
from art_ray.trajectories import TrajectoryGroup

RUN_TAG = "art_ray.model"


def group_metrics(groups: list[TrajectoryGroup], split: str) -> dict[str, float]:
    """ART-style reward metrics of one split: reward, its std-dev, exception rate, user metrics."""
    trajectories = [t for g in groups for t in g.trajectories]
    exceptions = sum(len(g.exceptions) for g in groups)
    metrics: dict[str, float] = {}
    if trajectories:
        rewards = [t.reward for t in trajectories]
        metrics[f"{split}/reward"] = statistics.fmean(rewards)
        metrics[f"{split}/reward_std_dev"] = statistics.pstdev(rewards)
        within = [statistics.pstdev(g.rewards) for g in groups if len(g.trajectories) > 1]
        if within:
            metrics[f"{split}/reward_std_dev_within_groups"] = statistics.fmean(within)
        names = {name for t in trajectories for name in t.metrics}
        for name in sorted(names):
            values = [float(t.metrics[name]) for t in trajectories if name in t.metrics]
            metrics[f"{split}/{name}"] = statistics.fmean(values)
    metrics[f"{split}/exception_rate"] = exceptions / max(1, exceptions + len(trajectories))
    metrics[f"{split}/num_trajectories"] = float(len(trajectories))
    return metrics


class Tracker:
    """One MLflow run per model; metrics are logged at the model's step."""

    def __init__(self, project: str, model: str, tracking_uri: str | None) -> None:
        import mlflow

        self._mlflow = mlflow
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        experiment = mlflow.set_experiment(project)
        self.tracking_uri = mlflow.get_tracking_uri()
        found = mlflow.search_runs(
            experiment_ids=[experiment.experiment_id],
            filter_string=f"tags.`{RUN_TAG}` = '{model}'",
            output_format="list",
            max_results=1,
        )
        client = mlflow.MlflowClient()
        # (metric, step) rows a resumed run already holds: a step the previous driver logged but had not
        # yet checkpointed when it died is trained again, and its rows are not logged a second time
        self._logged_before: set[tuple[str, int]] = set()
        if found:  # a resumed run is running again until finish()
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            self._logged_before = {
                (key, row.step)
                for key in found[0].data.metrics
                for row in client.get_metric_history(self.run_id, key)
            }
        else:
            run = client.create_run(experiment.experiment_id, run_name=model, tags={RUN_TAG: model})
            self.run_id = run.info.run_id
        self._client = client

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Finite values under names MLflow stores (a trajectory's metric named "" or with a control
        character would fail the whole batch); the rest stay in the Parquet only."""
        stored = {name.replace("@", "_"): value for name, value in metrics.items()}
        finite = {
            name: float(value)
            for name, value in stored.items()
            if isinstance(value, int | float)
            and math.isfinite(float(value))
            and storable_metric_name(name)
            and (name, step) not in self._logged_before
        }
        if finite:
            from mlflow.entities import Metric

            timestamp = int(time.time() * 1000)
            self._client.log_batch(
                self.run_id, metrics=[Metric(k, v, timestamp, step) for k, v in sorted(finite.items())]
            )

    def finish(self) -> None:
        """Mark the run FINISHED (its backend stopped training the model)."""
        self._client.set_terminated(self.run_id, "FINISHED")

    def history(self, metric: str) -> dict[int, float]:
        return {m.step: m.value for m in self._client.get_metric_history(self.run_id, metric)}


def storable_metric_name(name: str) -> bool:
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, path_not_unique, validate_param_and_metric_name

    return bool(
        0 < len(name) <= MAX_ENTITY_KEY_LENGTH
        and validate_param_and_metric_name(name)
        and not path_not_unique(name)
    )


def save_trajectories(model_dir: str, split: str, step: int, groups: list[TrajectoryGroup]) -> str:
    """The groups into the split's file of the step; a step's file keeps the groups of every call that
    logged at it (many `model.log` calls at one step, capture sessions logged as they end), in order."""
    path = f"{model_dir}/trajectories/{split}/{step:04d}.parquet"
    if storage.exists(path):
        groups = [*read_trajectory_groups(path), *groups]
    write_trajectory_groups(groups, path)
    return path
