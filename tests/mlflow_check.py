"""Read a run back from a real MLflow server and hold it against the run folder (``--mlflow``)."""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

# The numbers a resumed attempt trains again alike; samples/s is timed and differs per attempt.
TRAINED = ("train_loss", "lr", "val_loss", "val_accuracy", "epoch_train_loss", "epoch_lr")


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def runs_of(uri: str, experiment: str) -> list:
    """Every MLflow run of ``experiment``, oldest first."""
    mlflow = client(uri)
    found = mlflow.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    return mlflow.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def history(uri: str, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client(uri).get_metric_history(run_id, name))


def artifacts(uri: str, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client(uri).list_artifacts(run_id, path)}


def assert_tracks_folder(
    uri: str, run, folder: str | Path, checkpoint: str | Path, started_with: dict[str, str] | None = None
) -> None:
    """``run`` (an MLflow run) is the run folder's: params equal to ``checkpoint``'s config.yaml
    (but the options ``started_with``: the first attempt's, where a rerun changed them),
    each metric's steps once and equal to ``metrics.csv``'s rows, the trained numbers equal too,
    ``curves.png``, ``metrics.csv`` and ``config.yaml`` as artifacts, tags of folder and checkpoint, ended."""
    folder = Path(folder)
    config = yaml.safe_load((Path(checkpoint) / "config.yaml").read_text())
    assert run.data.params == {**{name: str(value) for name, value in config.items()}, **(started_with or {})}
    rows = list(csv.DictReader((folder / "metrics.csv").open()))
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for column, value in row.items():
            if column in ("kind", "global_step", "epoch") or not value:
                continue
            name = column if row["kind"] == "step" or column.startswith("val_") else f"epoch_{column}"
            expected.setdefault(name, []).append((int(row["global_step"]), float(value)))
    assert set(run.data.metrics) == set(expected)
    for name, points in expected.items():
        logged = history(uri, run.info.run_id, name)
        assert [step for step, _ in logged] == [step for step, _ in points], name  # each step once
        if name in TRAINED:
            assert logged == points, name
    assert {"curves.png", "metrics.csv", "config.yaml"} <= artifacts(uri, run.info.run_id)
    assert run.data.tags["raytrain_mp.run"] == str(folder)
    assert run.data.tags["raytrain_mp.checkpoint"] == str(checkpoint)
    assert run.info.status == "FINISHED"
