"""`raytrain-mp tune` on a real Ray: cluster-sized bad inputs, and one small sweep on digits that is
interrupted, resumed, and then checked end to end (table, plot, best YAML that `ddp` runs).

One sweep serves the sweep and the resume tests, since every trial costs a Ray Train start-up
(~20 s on 2 cores): 2 global batches x 2 base lrs, 2 epochs, ASHA, 1 worker per trial, on a
512-sample slice of digits. Tune is interrupted (SIGUSR1, which it treats as Ctrl+C) once two
trials are done, then the sweep is resumed from its folder: two trials before the interruption
and two after it, two at a time on the session's Ray. A one-trial sweep whose trial crashes
(``--inject-fault``) shows a failure recorded in the table.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
import yaml

from raytrain_mp.cli import main
from raytrain_mp.config import build_config
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.lr_schedule import scaled_lr
from raytrain_mp.run_log import CURVES_FILE, read_rows
from raytrain_mp.storage import locate

from helpers import assert_usage_error, run_cli, run_cli_json, session_cpus, session_gpus, write_digits_cut
from mlflow_check import artifacts, history, runs_of
from run_log_check import csv_as_events, read_events

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]  # real sweeps

BATCHES, LRS, EPOCHS = (64, 128), (0.05, 0.8), 2
TRIALS = len(BATCHES) * len(LRS)


@pytest.fixture(scope="module")
def small_digits(tmp_path_factory) -> str:
    """Digits cut to 512 train / 200 val samples: an epoch is 8 or 4 steps."""
    return write_digits_cut(tmp_path_factory.mktemp("digits") / "small", 512, 200)


def run_cli_result(*argv: str) -> tuple[int, dict]:
    """Exit code and last JSON line of a command run in-process (Ray's log lines share stdout)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main([*argv, "--json"])
    lines = [line for line in buffer.getvalue().splitlines() if line.startswith("{")]
    assert lines, buffer.getvalue()[-3000:]
    return code, json.loads(lines[-1])


def done_trials(experiment: Path) -> set[str]:
    """Trial folders whose last result Tune marked done (finished or stopped by ASHA)."""
    done = set()
    for result in experiment.glob("run_trial_*/result.json"):
        lines = result.read_text().splitlines()
        if lines and json.loads(lines[-1]).get("done"):
            done.add(result.parent.name)
    return done


def trial_traces(experiment: Path, trial: str) -> tuple[bytes, list[str]]:
    """What a rerun would change: the trial's reports, and its Train run's checkpoints."""
    trial_id = "_".join(trial.split("_")[2:4])  # run_trial_<experiment id>_<index>_...
    checkpoints = sorted(p.name for p in (experiment / f"train-{trial_id}").glob("checkpoint_*"))
    return (experiment / trial / "result.json").read_bytes(), checkpoints


def interrupt_when(condition, stop: threading.Event) -> threading.Thread:
    """Send SIGUSR1 to this process (Tune's handler ends the run gracefully) once ``condition()``,
    unless ``stop`` is set first (the run ended by itself)."""

    def watch() -> None:
        while not stop.wait(0.5):
            if condition():
                os.kill(os.getpid(), signal.SIGUSR1)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def end_of_job() -> None:
    """What the end of an interrupted ``raytrain-mp tune`` process does to its Ray job: its
    placement groups go. The test resumes in the same process (the same job), where the groups of
    trials that were starting when the signal came could hold the CPUs the resumed ones need."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    for group_id, group in placement_group_table().items():
        if group["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))


@pytest.fixture(scope="module")
def sweep(small_digits, tmp_path_factory, mlflow_server):
    storage = tmp_path_factory.mktemp("sweeps")
    experiment = storage / "lr"
    argv = [
        "tune", "--no-use-gpu", "--data", small_digits, "--global-batch-sizes", ",".join(map(str, BATCHES)),
        "--base-lrs", ",".join(map(str, LRS)), "--epochs", str(EPOCHS), "--scheduler", "asha",
        "--num-workers", "1", "--storage-path", str(storage), "--name", "lr", "--log-every", "0",
        "--seed", "1", "--weight-decays", "2e-4", "--label-smoothings", "0.1", "--mlflow", "--mlflow-experiment", "lr",
    ]  # fmt: skip
    # If Tune finished before the signal, this no-op absorbs it (and the resume test fails) instead
    # of SIGUSR1's default action ending the test session.
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    stop = threading.Event()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        try:
            watcher = interrupt_when(lambda: len(done_trials(experiment)) >= 2, stop)
            code, interrupted = run_cli_result(*argv)
        finally:
            stop.set()
            watcher.join()
            signal.signal(signal.SIGUSR1, previous)
        finished_before = {trial: trial_traces(experiment, trial) for trial in done_trials(experiment)}
        end_of_job()
        resumed = run_cli_json("tune", "--resume", str(experiment))
    return {
        "code": code,
        "interrupted": interrupted,
        "finished_before": finished_before,
        "resumed": resumed,
        "rows": pq.read_table(resumed["table_parquet"]).to_pylist(),
        "experiment": experiment,
        "storage": storage,
    }


def test_interrupted_sweep_says_how_to_resume(sweep):
    interrupted = sweep["interrupted"]
    assert sweep["code"] == 1
    assert interrupted["resume"] == f"raytrain-mp tune --resume {sweep['experiment']}"
    assert interrupted["unfinished"] >= 1 and interrupted["best"] is None  # Tune may not have made all trials yet
    assert (sweep["experiment"] / "sweep.yaml").is_file()
    assert "table_csv" not in interrupted  # the outputs describe finished sweeps


def test_resume_finishes_without_rerunning_finished_trials(sweep):
    rows = {r["trial"]: r for r in sweep["rows"]}
    assert len(rows) == TRIALS and "unfinished" not in sweep["resumed"]
    assert len(sweep["finished_before"]) >= 2
    for trial, traces in sweep["finished_before"].items():
        reports, checkpoints = traces
        assert reports and checkpoints, trial  # a real trace to compare: empty == empty would prove nothing
        assert trial_traces(sweep["experiment"], trial) == traces  # no new report, no new checkpoint
        assert rows[trial]["status"] in ("completed", "stopped")
    assert set(rows) >= set(sweep["finished_before"])


def test_sweep_table(sweep):
    rows = sweep["rows"]
    assert sorted((r["global_batch_size"], r["base_lr"]) for r in rows) == sorted(
        (b, lr) for b in BATCHES for lr in LRS
    )
    for r in rows:
        assert r["effective_lr"] == scaled_lr(r["base_lr"], r["global_batch_size"], 256, "linear")
        assert r["world_size"] == 1 and r["lr_rule"] == "linear" and r["optimizer"] == "sgd"
        assert (r["weight_decay"], r["label_smoothing"]) == (2e-4, 0.1)
        trained = yaml.safe_load(next((sweep["experiment"] / r["run"]).glob("**/config.yaml")).read_text())
        assert (trained["weight_decay"], trained["label_smoothing"]) == (2e-4, 0.1)  # what the trial trained with
        assert r["status"] in ("completed", "stopped") and r["error"] is None
        assert r["epochs_run"] in range(1, EPOCHS + 1)
        assert (r["epochs_run"] == EPOCHS) == (r["status"] == "completed")
        assert 0 <= r["best_val_accuracy"] <= 1 and r["best_val_accuracy"] >= r["final_val_accuracy"]
    # ASHA lets the first trial at each rung through, so some trial always runs every epoch.
    assert any(r["status"] == "completed" for r in rows)
    assert sum(sweep["resumed"]["trials_by_status"].values()) == TRIALS
    csv_lines = Path(sweep["resumed"]["table_csv"]).read_text().splitlines()
    assert len(csv_lines) == 1 + TRIALS and csv_lines[0].startswith('"trial","base_lr","global_batch_size"')


def test_every_trial_logs_its_epochs_once(sweep):
    """Each trial's Train run keeps its own metrics.csv and TensorBoard events (``--logdir`` the
    experiment shows them side by side); a trial the interruption cut short continued its log on
    resume. ASHA may stop a trial after it logged one more epoch than Tune counted."""
    for row in sweep["rows"]:
        run = locate(str(sweep["experiment"] / row["run"]), "run")
        rows = read_rows(run)
        epochs = [int(r["epoch"]) for r in rows if r["kind"] == "epoch"]
        assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= row["epochs_run"], (row["trial"], epochs)
        assert read_events(run) == pytest.approx(csv_as_events(rows), rel=1e-6)
        assert run.child(CURVES_FILE).is_file()  # drawn at every epoch end: Tune ends a trial before its loop does


def test_mlflow_holds_the_sweep_as_a_parent_with_a_child_a_trial(sweep, mlflow_server):
    """--mlflow, interrupted and resumed: one parent run (continued by --resume) with the sweep's
    outputs, and a child for each of the 4 trials holding its epochs once."""
    parent, *children = runs_of(mlflow_server, "lr")
    assert parent.info.run_name == "lr" and parent.info.status == "FINISHED"
    assert {"best.yaml", "sweep_lr.png", "sweep_table.csv"} <= artifacts(mlflow_server, parent.info.run_id)
    assert sorted(child.info.run_name for child in children) == sorted(row["run"] for row in sweep["rows"])
    assert_children_hold_their_runs(mlflow_server, parent, children, sweep["experiment"])


def test_sweep_plot_and_best_yaml(sweep, small_digits):
    resumed = sweep["resumed"]
    assert Path(resumed["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = max(sweep["rows"], key=lambda r: r["best_val_accuracy"])
    assert resumed["best"]["trial"] == best["trial"] and resumed["best"]["base_lr"] == best["base_lr"]
    cfg = build_config(DDPConfig, {"config": resumed["best_yaml"]})
    assert (cfg.base_lr, cfg.global_batch_size, cfg.epochs, cfg.num_workers, cfg.seed) == (
        best["base_lr"],
        best["global_batch_size"],
        EPOCHS,
        1,
        1,
    )
    # What the sweep chose and the user gave, not this machine: no use_gpu (the sweep's --no-use-gpu
    # is machine state), no storage.
    assert (cfg.data, cfg.name, cfg.use_gpu, cfg.storage_path) == (small_digits, None, None, DDPConfig.storage_path)


def test_ddp_runs_the_best_yaml(sweep, tmp_path, mlflow_server, monkeypatch):
    """best.yaml carries the sweep's options, --mlflow included: the run is tracked where the sweep was."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    resumed = sweep["resumed"]
    out = run_cli_json(
        "ddp",
        "--config",
        resumed["best_yaml"],
        "--no-use-gpu",
        "--epochs",
        "1",
        "--storage-path",
        str(tmp_path),
        "--name",
        "best",
    )
    assert out["global_batch_size"] == resumed["best"]["global_batch_size"] and out["epochs"] == 1
    assert out["world_size"] == 1 and out["val_count"] == 200
    (tracked,) = [run for run in runs_of(mlflow_server, "lr") if run.data.tags["raytrain_mp.run"] == out["run"]]
    assert "mlflow.parentRunId" not in tracked.data.tags
    assert tracked.data.params["base_lr"] == str(resumed["best"]["base_lr"])


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["--num-workers", "{cpus}", "--no-use-gpu"],
            [
                "--num-workers {cpus}: a trial needs {cpus+1} CPUs (1 for its driver + {cpus} x --cpus-per-worker 1)",
                "has {cpus}",
                "at most {cpus-1} workers",
            ],
        ),
        (
            ["--num-workers", "1", "--max-concurrent-trials", "{cpus//2+1}", "--no-use-gpu"],
            ["--max-concurrent-trials: {cpus//2+1} trials do not fit", "at most {cpus//2}"],
        ),
        (
            ["--num-workers", "{gpus+1}", "--use-gpu"],
            ["--num-workers {gpus+1}: a trial needs {gpus+1} GPUs but the Ray cluster has {gpus}"],
        ),
    ],
    ids=["workers-over-cpus", "trials-over-cpus", "workers-over-gpus"],
)
def test_trials_larger_than_the_cluster(ray_session, small_digits, tmp_path, capsys, argv, fragments):
    # Counts from the session's CPUs and GPUs, whatever machine runs the test: "{gpus+1}" is one
    # worker more than the cluster has GPUs, which its CPUs hold beside the driver
    # (helpers.session_cpus). The global batch divides among the workers, so the check under test
    # is the one that refuses.
    cpus, gpus = session_cpus(), session_gpus()
    counts = {
        "cpus": cpus,
        "cpus+1": cpus + 1,
        "cpus-1": cpus - 1,
        "cpus//2": cpus // 2,
        "cpus//2+1": cpus // 2 + 1,
        "gpus": gpus,
        "gpus+1": gpus + 1,
    }
    argv, fragments = ([text.format_map(counts) for text in texts] for texts in (argv, fragments))
    batch = 16 * int(argv[argv.index("--num-workers") + 1])
    runs = tmp_path / "runs"
    res = run_cli(
        capsys, "tune", "--data", small_digits, "--storage-path", str(runs), "--global-batch-sizes", str(batch), *argv
    )
    assert_usage_error(res, *fragments)
    assert not runs.exists()  # no trial started, nothing written


def test_a_failed_trial_is_recorded(small_digits, tmp_path):
    marker = tmp_path / "crashed"
    code, out = run_cli_result(
        "tune", "--no-use-gpu", "--data", small_digits, "--global-batch-sizes", "64", "--base-lrs", "0.1",
        "--epochs", "2", "--scheduler", "none", "--num-workers", "1", "--storage-path", str(tmp_path),
        "--name", "fails", "--log-every", "0", "--inject-fault", f"0:1:{marker}",
    )  # fmt: skip
    assert code == 1 and marker.is_file()  # no trial succeeded: nothing to recommend
    assert out["trials_by_status"] == {"error": 1} and out["best"] is None and out["best_yaml"] is None
    (row,) = pq.read_table(out["table_parquet"]).to_pylist()
    assert row["status"] == "error" and "injected fault: rank 0 after epoch 1" in row["error"]
    assert row["epochs_run"] <= 1 and Path(out["plot"]).is_file()


def test_optuna_draws_the_population_pbt_perturbs_and_the_summary_names_the_best(
    ray_session, small_digits, tmp_path, mlflow_server, monkeypatch
):
    """Also --mlflow: the sweep is a parent MLflow run with its outputs, each trial a child holding
    one point an epoch, also across PBT's fork of a trial into a new Train run."""
    from raytrain_mp.config import build_config
    from raytrain_mp.tune.config import TuneConfig
    from raytrain_mp.tune.search import optuna_population

    flags = {"global_batch_sizes": "64", "lr_min": "0.05", "lr_max": "0.8", "search": "optuna", "scheduler": "pbt",
             "num_samples": "2", "epochs": "2", "num_workers": "1"}  # fmt: skip
    argv = [part for name, value in flags.items() for part in (f"--{name.replace('_', '-')}", value)]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    code, out = run_cli_result(
        "tune", *argv, "--no-use-gpu", "--data", small_digits, "--storage-path", str(tmp_path), "--name", "pbt",
        "--log-every", "0", "--mlflow", "--mlflow-experiment", "sweeps",
    )  # fmt: skip
    assert code == 0 and out["trials"] == 2 and out["trials_by_status"] == {"completed": 2}
    experiment = tmp_path / "pbt"
    # the starting points are the seeded QMC draws (Tune's PBT takes no searcher); a trial's first
    # report carries its starting config (PBT rewrites params.json when it perturbs one)
    starts = sorted(
        json.loads(p.read_text().splitlines()[0])["config"]["base_lr"]
        for p in experiment.glob("run_trial_*/result.json")
    )
    population = optuna_population(build_config(TuneConfig, {**flags, "storage_path": str(tmp_path)}))
    assert starts == sorted(p["base_lr"] for p in population)
    rows = pq.read_table(out["table_parquet"]).to_pylist()
    assert out["best"]["trial"] == max(rows, key=lambda row: row["best_val_accuracy"])["trial"]
    assert all(row["epochs_run"] == 2 and (experiment / row["run"]).is_dir() for row in rows)
    parent, *children = runs_of(mlflow_server, "sweeps")
    assert parent.info.run_name == "pbt" and parent.info.status == "FINISHED"
    outputs = {"best.yaml", "config.yaml", "sweep_lr.png", "sweep_table.csv"}
    assert artifacts(mlflow_server, parent.info.run_id) == outputs
    # a child a Train run: each trial's first, and a new one where PBT exploited another's checkpoint
    assert sorted(child.info.run_name for child in children) == sorted(
        p.name for p in experiment.glob("train-*") if not p.name.endswith("-start")
    )
    assert len({child.data.tags["raytrain_mp.trial"] for child in children}) == 2
    assert_children_hold_their_runs(mlflow_server, parent, children, experiment)
    assert {c.info.status for c in children if c.info.run_name in {row["run"] for row in rows}} == {"FINISHED"}


def assert_children_hold_their_runs(uri: str, parent, children: list, experiment: Path) -> None:
    """Each child of ``parent`` holds its Train run's epochs (``metrics.csv``), each step once."""
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        rows = read_rows(locate(str(experiment / child.info.run_name), "run"))
        epochs = [(int(r["global_step"]), float(r["val_accuracy"])) for r in rows if r["kind"] == "epoch"]
        assert history(uri, child.info.run_id, "val_accuracy") == epochs
