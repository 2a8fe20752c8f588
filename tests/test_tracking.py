"""MLflow tracking (``tracking``) against a real ``mlflow server`` on 127.0.0.1, without Ray: the
options' one-line errors, finding and continuing a run, the run log's rows as metrics with each
step once across attempts, and an unreachable server that costs one warning line.
The commands' runs (ddp, pipeline, tune, eval with ``--mlflow``) are checked in their own tests:
tests/ddp/test_ddp_train.py, tests/pipeline/test_pipeline_cli.py, tests/tune/test_tune_sweep.py."""

from __future__ import annotations

import dataclasses
import time

import pytest

from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.run_log import RunLog
from raytrain_mp.storage import locate
from raytrain_mp.tracking import Tracker, absolute_uri, close_run, log_outputs, open_run, params_of

from helpers import closed_port, run_cli, run_without
from mlflow_check import artifacts, history, runs_of


@pytest.mark.parametrize("command", ["ddp", "pipeline", "tune", "eval"])
def test_an_experiment_without_mlflow_is_one_line(capsys, tmp_path, command):
    extra = ["--checkpoint", str(tmp_path)] if command == "eval" else ["--storage-path", str(tmp_path / "runs")]
    result = run_cli(capsys, command, "--mlflow-experiment", "mine", *extra)
    assert (result.code, result.out) == (2, "")
    assert result.err.strip().splitlines() == ["raytrain-mp: error: --mlflow-experiment: needs --mlflow"]
    assert not (tmp_path / "runs").exists()


def test_mlflow_missing_is_one_line_before_anything_runs(tmp_path):
    done = run_without("mlflow", "ddp", "--mlflow", "--storage-path", str(tmp_path / "runs"))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.strip().splitlines() == [
        "raytrain-mp: error: --mlflow: needs MLflow, which is not installed; accepted: pip install "
        "'raytrain_mp[mlflow]'"
    ]
    assert not (tmp_path / "runs").exists()


def test_local_tracking_uris_become_absolute(tmp_path, monkeypatch):
    """Ray's workers and Tune's trials run in other folders: MLflow's default (a SQLite file in the
    working folder) must name the same file for all of them."""
    monkeypatch.chdir(tmp_path)
    assert absolute_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    assert absolute_uri("file:./mlruns") == f"file://{tmp_path}/mlruns"
    assert absolute_uri("mlruns") == f"{tmp_path}/mlruns"
    for uri in ("sqlite:////data/mlflow.db", "file:///data/mlruns", "http://127.0.0.1:5000", "databricks"):
        assert absolute_uri(uri) == uri


def tracked_config(tmp_path, experiment: str, **options) -> DDPConfig:
    return DDPConfig(mlflow=True, mlflow_experiment=experiment, storage_path=str(tmp_path), name="run", **options)


def test_a_run_is_continued_by_its_key_only_when_it_resumes(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = tracked_config(tmp_path, "keys", base_lr=0.2)
    first = open_run(cfg, "s3://bucket/run", "run", resumes=True, tags={"raytrain_mp.run": "s3://bucket/run"})
    assert first.mlflow_tracking_uri == mlflow_server and first.mlflow_run_id
    # a rerun under other options keeps the params it started with; an option it lacked is added
    rerun = dataclasses.replace(cfg, base_lr=0.4, model_ema=True)
    again = open_run(rerun, "s3://bucket/run", "run", resumes=True)
    assert again.mlflow_run_id == first.mlflow_run_id
    fresh = open_run(cfg, "s3://bucket/run", "run", resumes=False)  # the folder's run started over
    other = open_run(cfg, "s3://bucket/other", "other", resumes=True)
    assert len({first.mlflow_run_id, fresh.mlflow_run_id, other.mlflow_run_id}) == 3
    runs = {run.info.run_id: run for run in runs_of(mlflow_server, "keys")}
    assert runs[first.mlflow_run_id].data.params == params_of(cfg)
    assert runs[first.mlflow_run_id].data.params["base_lr"] == "0.2"
    assert runs[first.mlflow_run_id].data.tags["raytrain_mp.run"] == "s3://bucket/run"


def test_the_run_log_reaches_mlflow_with_each_step_once_across_attempts(mlflow_server, tmp_path, monkeypatch):
    """Attempt 1 publishes after step 6 (a checkpoint) and logs steps 7-8 past it before it dies
    (their rows reach MLflow at its next publish, as before a checkpoint that was never
    registered); attempt 2 resumes at step 6: steps 7 and 8 are not logged again, and nothing is missing."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = open_run(tracked_config(tmp_path, "attempts"), "run", "run", resumes=False)
    run = locate(str(tmp_path / "run"), "run")

    def attempt(start: int, stop: int, publish_at: tuple[int, ...]) -> None:
        log = RunLog(run, start, 64, tracker=Tracker.of(cfg))
        for step in range(start + 1, stop + 1):
            log.step(step, 1 + (step - 1) // 5, train_loss=10.0 / step, lr=0.1 * step)
            if step % 5 == 0:
                log.epoch(step, {"epoch": step // 5, "train_loss": 1.0 / step, "val_accuracy": step / 100, "lr": 0.5})
            if step in publish_at:
                log.publish()

    attempt(0, 8, publish_at=(6, 8))  # dies after step 8's publish; its checkpoint at 6 is the newest
    attempt(6, 12, publish_at=(12,))
    assert history(mlflow_server, cfg.mlflow_run_id, "train_loss") == [(s, 10.0 / s) for s in range(1, 13)]
    assert history(mlflow_server, cfg.mlflow_run_id, "val_accuracy") == [(5, 0.05), (10, 0.1)]
    assert history(mlflow_server, cfg.mlflow_run_id, "epoch_train_loss") == [(5, 0.2), (10, 0.1)]
    assert [s for s, _ in history(mlflow_server, cfg.mlflow_run_id, "samples_per_second")] == list(range(1, 13))


def test_an_unreachable_server_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = tracked_config(tmp_path, "nowhere")
    started = time.monotonic()
    opened = open_run(cfg, "run", "run", resumes=True)
    assert time.monotonic() - started < 60  # not MLflow's default minutes of retries
    assert opened == cfg  # no MLflow run: rank 0 logs locally only
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"raytrain-mp: warning: MLflow at {uri}: ") and line.endswith(
        "; the run goes on without it (metrics.csv and TensorBoard as always)"
    )
    # a server lost mid-run: the first failed publish warns once, the log goes on
    warnings: list[str] = []
    log = RunLog(locate(str(tmp_path / "run"), "run"), 0, 64, tracker=Tracker(uri, "0" * 32, warnings.append))
    for step in (1, 2):
        log.step(step, 1, train_loss=1.0, lr=0.1)
        log.publish()
    log.close()
    assert len(warnings) == 1 and warnings[0].startswith(f"MLflow at {uri}: ")
    assert (tmp_path / "run" / "metrics.csv").read_text().count("\nstep,") == 2


def test_outputs_join_the_run_of_their_folder_and_leave_its_status(mlflow_server, tmp_path, monkeypatch):
    """``eval --mlflow``'s files go under ``eval/OUT`` of the run that trained the checkpoint (its
    status as it was: a failed run stays FAILED), or into a new run for a folder MLflow never saw."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = tracked_config(tmp_path, "outputs")
    failed = open_run(cfg, "/runs/failed", "failed", resumes=False)
    close_run(failed, "FAILED", {})
    (tmp_path / "eval.json").write_text("{}")
    for folder in ("/runs/failed", "/runs/untracked"):
        log_outputs(cfg, folder, f"eval {folder}", [tmp_path / "eval.json"], "eval/val-1")
    runs = {run.info.run_name: run for run in runs_of(mlflow_server, "outputs")}
    assert {name: run.info.status for name, run in runs.items()} == {
        "failed": "FAILED", "eval /runs/untracked": "FINISHED"
    }  # fmt: skip
    for run in runs.values():
        assert artifacts(mlflow_server, run.info.run_id, "eval/val-1") == {"eval/val-1/eval.json"}
