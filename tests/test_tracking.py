"""The MLflow tracker on a real sqlite store: a resumed run never holds a (metric, step) row twice."""

from __future__ import annotations

from art_ray.tracking import Tracker


def test_a_resumed_run_does_not_log_a_step_the_dead_driver_had_logged(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = Tracker("tracking-tests", "model", uri)
    first.log_metrics({"loss/train": 0.5}, step=1)
    first.log_metrics({"loss/train": 0.4, "train/reward": 0.2}, step=2)  # then the driver dies
    resumed = Tracker("tracking-tests", "model", uri)  # the checkpoint was at step 1: step 2 is trained again
    assert resumed.run_id == first.run_id
    resumed.log_metrics({"loss/train": 0.45, "train/reward": 0.3, "grad_norm": 1.0}, step=2)
    resumed.log_metrics({"loss/train": 0.3}, step=3)
    resumed.log_metrics({"loss/train": 0.25}, step=3)  # this process's own rows are not filtered
    assert sorted(r.step for r in resumed._client.get_metric_history(resumed.run_id, "loss/train")) == [
        1,
        2,
        3,
        3,
    ]
    assert resumed.history("train/reward") == {2: 0.2}
    assert resumed.history("grad_norm") == {2: 1.0}


def test_metric_names_mlflow_cannot_store_stay_out_of_the_batch() -> None:
    """Found by fuzzing /_art/log: a group metric named "" (or with a control character) failed the whole
    MLflow batch, a 500; such names are left to the Parquet, the rest logged."""
    from art_ray.tracking import storable_metric_name

    assert storable_metric_name("val/reward") and storable_metric_name("train/a b:c-d.e_f")
    assert not storable_metric_name("") and not storable_metric_name("a\x10b")
    assert not storable_metric_name("x" * 251) and not storable_metric_name("a/../b")


def test_every_log_at_one_step_keeps_its_groups_in_the_step_file(tmp_path) -> None:
    """Found by the soak: capture sessions logged one by one at step 0 left only the last in the split's
    Parquet (each call rewrote the file). Now the step's file holds every call's groups, in order."""
    from art_ray import Trajectory, TrajectoryGroup, read_trajectory_groups
    from art_ray.tracking import save_trajectories

    def group(text: str) -> TrajectoryGroup:
        messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
        return TrajectoryGroup([Trajectory(messages_and_choices=messages, reward=1.0)])

    path = save_trajectories(str(tmp_path), "val", 0, [group("first")])
    assert save_trajectories(str(tmp_path), "val", 0, [group("second"), group("third")]) == path
    save_trajectories(str(tmp_path), "val", 1, [group("next step")])
    kept = read_trajectory_groups(path)
    assert [g.trajectories[0].messages_and_choices[0]["content"] for g in kept] == [
        "first",
        "second",
        "third",
    ]
    assert sorted(p.name for p in (tmp_path / "trajectories" / "val").iterdir()) == [
        "0000.parquet",
        "0001.parquet",
    ]
