"""`raytrain-mp pipeline` end to end: bad inputs before any actor, a killed stage resumes exactly
(after an epoch, or mid-epoch from a --checkpoint-every-steps checkpoint, with the same or another
number of replicas), whoever reads the batches (loader processes or the stage actor)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile

import pytest
import torch

from raytrain_mp.cli import main
from raytrain_mp.faults import ABRUPT
from raytrain_mp.models import build_model
from raytrain_mp.run_log import read_rows
from raytrain_mp.storage import locate

from helpers import (
    RAY_FORWARDED,
    CliResult,
    assert_usage_error,
    run_cli,
    run_cli_json,
    run_cli_text,
    session_cpus,
    session_gpus,
)
from killer import Killer, exists
from mlflow_check import assert_tracks_folder, runs_of
from run_log_check import checked_run_log


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    """160 train / 40 val 8x8 grey images: 5 steps of 32 per epoch."""
    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import make_synthetic_source

    out = tmp_path_factory.mktemp("pipe") / "d"
    write_dataset(make_synthetic_source(200, 8, 4, 1, 0.2, 11), out)
    return str(out)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--stages", "19"], ["--stages: 19 stages for 18 blocks"]),
        (["--split-points", "layer9"], ["--split-points: 'layer9' names no block", "layer3.0.conv2"]),
        (["--stages", "3", "--split-points", "layer3,layer2"], ["--split-points", "order"]),
        (
            ["--split-points", "layer2,layer3"],
            ["--split-points: 2 split point(s) make 3 stages, not 2 (--stages 2 x --virtual-stages 1)"],
        ),
        (
            ["--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--split-points", "layer2"],
            ["--split-points: 1 split point(s) make 2 stages, not 4 (--stages 2 x --virtual-stages 2)"],
        ),
        (["--microbatches", "0"], ["--microbatches: must be between 1 and --global-batch-size 32, got 0"]),
        (["--microbatches", "33"], ["--microbatches: must be between 1 and --global-batch-size 32, got 33"]),
        (
            ["--stages", "4", "--schedule", "1f1b", "--microbatches", "2"],
            ["--microbatches: 1F1B over 4 stages needs at least 4 micro-batches, got 2"],
        ),
        (
            ["--microbatches", "3"],
            ["--microbatches: must divide --global-batch-size 32 into equal micro-batches", "got 3"],
        ),
        (
            ["--schedule", "interleaved-zb"],
            ["--virtual-stages: interleaved-zb needs at least 2 stages per rank, got 1"],
        ),
        (["--virtual-stages", "2"], ["--virtual-stages: the gpipe schedule runs one stage per rank, got 2"]),
        (["--schedule", "interleaved-1f1b", "--virtual-stages", "10"], ["--stages: 20 stages for 18 blocks"]),
        (["--precision", "fp16"], ["--precision", "invalid choice: 'fp16'"]),
        (["--memory-format", "nhwc"], ["--memory-format", "invalid choice: 'nhwc'"]),
        (["--global-batch-size", "500"], ["--global-batch-size 500 exceeds the 160 training samples"]),
        (["--replicas", "0"], ["--replicas: must be >= 1, got 0"]),
        (["--steps-per-call", "0"], ["--steps-per-call: must be >= 1, got 0"]),
        (["--balance-trials", "-1"], ["--balance-trials: must be >= 0, got -1"]),
        (
            ["--balance-trials", "2", "--balance", "params"],
            ["--balance-trials: tries the cuts of --balance time on running stages; this run cuts by --balance params"],
        ),
        (
            ["--balance-trials", "2", "--split-points", "layer3"],
            ["--balance-trials: tries the cuts of --balance time on running stages; this run cuts by --split-points"],
        ),
        (
            ["--replicas", "3"],
            [
                "--replicas: 3 replicas x --microbatches 4 must divide --global-batch-size 32 into equal "
                "micro-batches, got 3"
            ],
        ),
    ],
)
def test_bad_inputs_before_any_actor(tiny_data, tmp_path, capsys, argv, fragments):
    runs = tmp_path / "runs"
    base = [
        "pipeline",
        "--data",
        tiny_data,
        "--model",
        "resnet18",
        "--global-batch-size",
        "32",
        "--storage-path",
        str(runs),
    ]
    res = run_cli(capsys, *base, *argv)
    assert_usage_error(res, *fragments)
    assert not runs.exists()


def test_more_stages_than_gpus(ray_session, tiny_data, tmp_path, capsys):
    gpus = session_gpus()
    stages = str(max(2, gpus + 1))  # more stages than the cluster has GPUs, which its CPUs hold (helpers.session_cpus)
    res = run_cli(capsys, "pipeline", "--data", tiny_data, "--model", "resnet18", "--global-batch-size", "32",
                  "--stages", stages, "--use-gpu", "--storage-path", str(tmp_path / "runs"))  # fmt: skip
    assert_usage_error(res, "--use-gpu", f"{stages} stages need {stages} GPU (1 each); the Ray cluster has {gpus}")


def test_more_replicas_than_the_cluster_holds(ray_session, tiny_data, tmp_path, capsys):
    runs = tmp_path / "runs"
    cpus = session_cpus()
    replicas = cpus // 2 + 1  # of 2 stages: one replica more than the session's CPUs hold
    res = run_cli(capsys, "pipeline", "--data", tiny_data, "--model", "resnet18",
                  "--global-batch-size", str(replicas * 2 * 4), "--replicas", str(replicas), "--microbatches", "2",
                  "--storage-path", str(runs))  # fmt: skip
    assert_usage_error(
        res,
        f"--cpus-per-stage: {replicas} replicas x 2 stages need {2 * replicas} CPU (1 each); the Ray cluster has "
        f"{cpus}",
    )
    assert not runs.exists()


# torchvision's recipe as the pipeline takes it: per-sample auto-augment and erasing, mixup or cutmix
# a step (pixels on the first stage, labels on the last), label smoothing, BatchNorm weight decay and
# a weight average of each stage (updated every step; the reference's adjustment makes 0.999 0.968),
# repeated augmentation (each sample read twice an epoch).
RECIPE = ["--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
          "--label-smoothing", "0.1", "--norm-weight-decay", "0.01", "--model-ema", "--model-ema-steps", "1",
          "--model-ema-decay", "0.999", "--ra-sampler", "--ra-reps", "2"]  # fmt: skip


def max_diff(a_pt: str, b_pt: str) -> float:
    """The largest difference between two state dict files' tensors (the same keys)."""
    a, b = (torch.load(pt, weights_only=True) for pt in (a_pt, b_pt))
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k].numel())


def fp64_args(tiny_data: str, storage: str) -> list[str]:
    """The fp64 runs' arguments: 2 epochs of 5 steps, 2 stages, 1F1B over 4 micro-batches, the recipe."""
    return ["pipeline", "--no-use-gpu", "--data", tiny_data, "--model", "resnet18", "--stages", "2",
            "--global-batch-size", "32", "--microbatches", "4", "--schedule", "1f1b", "--epochs", "2",
            "--precision", "fp64", "--balance", "params", "--storage-path", storage, "--log-every", "1", "--augment",
            "--loader-workers", "1", *RECIPE]  # fmt: skip


@contextlib.contextmanager
def captured_output():
    """This process's stdout and stderr, Python's and the file descriptors' (what ``capfd``
    captures, for a module fixture): yields a dict that holds ``out`` and ``err`` afterwards."""
    files = {name: io.TextIOWrapper(tempfile.TemporaryFile(buffering=0), write_through=True) for name in ("out", "err")}
    captured: dict[str, str] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(files["out"].fileno(), 1)
    os.dup2(files["err"].fileno(), 2)
    try:
        with contextlib.redirect_stdout(files["out"]), contextlib.redirect_stderr(files["err"]):
            yield captured
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for name, file in files.items():
            file.seek(0)
            captured[name] = file.read()
            file.close()
        os.close(saved[0])
        os.close(saved[1])


@pytest.fixture(scope="module")
def fp64_runs(ray_session, tiny_data, tmp_path_factory, mlflow_server):
    """The plain run, and the killed run: its stages' first start is killed from outside (``Killer``),
    its stage 1 after global step 8 (step 3 of epoch 2, before that step's checkpoint), and then a
    new stage actor while the stages are rebuilt: three failures of --max-failures 3, and it resumes
    from the checkpoint after step 6; 3 steps a Ray call. It must still equal the plain run, step by
    step. The killed run logs to MLflow (experiment ``pipeline``)."""
    storage = str(tmp_path_factory.mktemp("pruns"))
    marker = tmp_path_factory.mktemp("pfault") / "killed"
    args = fp64_args(tiny_data, storage)
    plain = run_cli_json(*args, "--name", "plain")

    def kill_at_the_first_start_and_while_rebuilding() -> None:
        killer.kill_first_new(why="during the first start")
        killer.kill_first_new(after=exists(marker), why="while the stages are rebuilt")

    with Killer("ray::StageWorker") as killer, captured_output() as output, pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        killer.start(kill_at_the_first_start_and_while_rebuilding)
        try:
            code = main([*args, "--name", "killed", "--max-failures", "3", "--inject-fault", f"1:s8:{marker}",
                         "--steps-per-call", "3", "--checkpoint-every-steps", "2", "--json",
                         "--mlflow", "--mlflow-experiment", "pipeline"])  # fmt: skip
        except SystemExit as exc:
            code = exc.code
    killed = CliResult(code, output["out"], output["err"])
    assert killed.code == 0, killed.out[-3000:] + killed.err[-3000:]
    return plain, killed.last_json, marker, killed, killer.kills


@pytest.mark.slow  # the fp64 runs
def test_killed_stage_resumes_mid_epoch_from_checkpoint(fp64_runs):
    from pathlib import Path

    plain, killed, marker, _, _ = fp64_runs
    assert marker.read_text() == "killed stage 1 after step 8\n"
    assert killed["epochs"] == plain["epochs"] == 2
    assert killed["train_loss"] == pytest.approx(
        plain["train_loss"], rel=1e-9
    )  # epoch 2's loss carried over the restart
    # Global steps 2, 4 (epoch 1), 6, 8 (epoch 2) and the epochs' ends; the 2 newest are kept.
    assert sorted(p.name for p in Path(killed["run"]).glob("checkpoint_*")) == [
        "checkpoint_000002",
        "checkpoint_000002_step_000003",
    ]
    assert max_diff(plain["model"], killed["model"]) < 1e-9
    assert max_diff(plain["ema"], killed["ema"]) < 1e-9  # the weight average was restored from ema.pt
    assert killed["val_accuracy_ema"] == plain["val_accuracy_ema"]
    assert max_diff(plain["model"], plain["ema"]) > 1e-3  # the average is not the model


@pytest.mark.slow  # the fp64 runs
def test_the_killed_run_logs_every_step_once_with_the_plain_runs_numbers(fp64_runs):
    """Its log continues from the checkpoint after step 6: steps 7 and 8, logged before the kill,
    are neither missing nor twice in metrics.csv and the TensorBoard events (``checked_run_log``)."""
    plain, killed, _, _, _ = fp64_runs
    plain_rows, killed_rows = (
        checked_run_log(run["run"], steps=10, epochs=2, steps_per_epoch=5) for run in (plain, killed)
    )
    for a, b in zip(plain_rows, killed_rows, strict=True):
        assert (a["kind"], a["global_step"], a["lr"]) == (b["kind"], b["global_step"], b["lr"])
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-9)
        assert 0 <= float(b["bubble_fraction"]) < 1
    assert [r["val_accuracy"] for r in plain_rows if r["kind"] == "epoch"][-1] == repr(plain["val_accuracy"])


@pytest.mark.slow  # the fp64 runs
def test_mlflow_holds_the_killed_run_once_across_its_restarts(fp64_runs, mlflow_server):
    """One MLflow run across the three restarts, with metrics.csv's rows, each step once; its params
    are the options the run started with (the cut its balancing chose is the checkpoint's)."""
    _, killed, _, _, _ = fp64_runs
    (run,) = runs_of(mlflow_server, "pipeline")
    assert_tracks_folder(mlflow_server, run, killed["run"], killed["checkpoint"], started_with={"split_points": "None"})


@pytest.mark.slow  # the fp64 runs
def test_summary_and_model_pt(fp64_runs):
    plain, *_ = fp64_runs
    for key in ("val_accuracy", "train_loss", "samples_per_second", "bubble_fraction"):
        assert isinstance(plain[key], float) and plain[key] >= 0
    assert (plain["num_stages"], plain["num_microbatches"], plain["schedule"]) == (2, 4, "1f1b")
    assert plain["val_count"] == 40
    assert [s["index"] for s in plain["stages"]] == [0, 1]
    model = build_model("resnet18", 4, in_channels=1, small_stem=True)
    model.load_state_dict(torch.load(plain["model"], weights_only=True), strict=True)


@pytest.mark.slow  # the fp64 runs
def test_rerun_of_a_finished_run_prints_its_summary_and_starts_nothing(fp64_runs, tiny_data):
    """As a user reruns it: a new process, no Ray of its own (no dashboard line), the same summary."""
    import json
    import subprocess
    from pathlib import Path

    plain, *_ = fp64_runs
    storage = str(Path(plain["run"]).parent)
    done = subprocess.run(
        ["raytrain-mp", "pipeline", "--no-use-gpu", "--data", tiny_data, "--model", "resnet18", "--stages", "2",
         "--global-batch-size", "32", "--epochs", "2", "--storage-path", storage, "--name", "plain", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == plain  # the JSON line alone: no Ray started, no epoch ran
    assert done.stderr == ""
    # Without --json, as a person reads it: a short line per stage, the block lists only in the JSON.
    text = subprocess.run(done.args[:-1], capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr[-2000:]
    lines = text.stdout.splitlines()
    stages = [line for line in lines if line.startswith("  stage ")]
    assert [line.split(":")[0] for line in stages] == ["  stage 0", "  stage 1"], text.stdout
    assert all(f"on node {stage['node_id'][:8]}" in line for stage, line in zip(plain["stages"], stages))
    assert max(map(len, lines)) <= 160 and "node_id" not in text.stdout, text.stdout


@pytest.mark.slow  # the fp64 runs
def test_resume_keeps_the_saved_split_and_refuses_another(fp64_runs, tiny_data, tmp_path, capsys):
    import shutil
    from pathlib import Path

    plain, *_ = fp64_runs
    saved = [stage["blocks"][0] for stage in plain["stages"][1:]]
    other = "layer2" if saved != ["layer2.0"] else "layer3"
    storage = tmp_path / "runs"
    shutil.copytree(Path(plain["run"]), storage / "copy")
    base = ["pipeline", "--no-use-gpu", "--data", tiny_data, "--model", "resnet18", "--global-batch-size", "32",
            "--microbatches", "4", "--precision", "fp64", "--storage-path", str(storage), "--name", "copy",
            "--epochs", "3", "--log-every", "0"]  # fmt: skip
    checkpoint = storage / "copy" / "checkpoint_000002"
    where = f"{checkpoint} was trained with 2 stages cut before {','.join(saved)}"
    res = run_cli(capsys, *base, "--split-points", other)
    assert_usage_error(res, f"--split-points: {where}, not {other}; accepted: --split-points {','.join(saved)}")
    for other_layout in (
        ["--stages", "3"],
        ["--stages", "1", "--schedule", "interleaved-1f1b", "--virtual-stages", "2"],
    ):
        res = run_cli(capsys, *base, *other_layout)
        asked = f"--stages {other_layout[1]} x --virtual-stages {other_layout[-1] if len(other_layout) > 2 else 1}"
        assert_usage_error(
            res,
            f"--stages: {where} on 2 stage actors x 1 virtual stages, not {asked}; accepted: --stages 2 "
            "--virtual-stages 1",
        )
    assert sorted(p.name for p in (storage / "copy").glob("checkpoint_*")) == ["checkpoint_000001", "checkpoint_000002"]
    # --balance time would profile and cut anew, and --balance-trials try cuts; the resumed run keeps
    # the checkpoint's cut instead.
    resumed = run_cli_json(*base, "--balance", "time", "--balance-trials", "1")
    assert resumed["epochs"] == 3
    rows = read_rows(
        locate(resumed["run"], "run")
    )  # the copied run's log, continued by epoch 3 (no step rows: --log-every 0)
    assert [(r["kind"], r["global_step"]) for r in rows][-3:] == [("step", "10"), ("epoch", "10"), ("epoch", "15")]
    assert [stage["blocks"] for stage in resumed["stages"]] == [stage["blocks"] for stage in plain["stages"]]


@pytest.mark.slow  # more fp64 runs
def test_replicas_survive_a_killed_actor_and_a_change_of_replicas(fp64_runs, tiny_data, tmp_path):
    """--replicas 2 x --microbatches 2 runs the same 4 micro-batches per step as the plain run
    (--replicas 1 x --microbatches 4), so the run here ends with its model (1e-9, fp64): trained
    with 1 replica until it fails after step 3, it is rerun with 2 replicas, which continues with
    step 4 from the checkpoint after step 2, and whose actor of replica 1, stage 0 is killed after
    epoch 1 and rebuilt from the checkpoint. The stage actors read the batches themselves here (no
    loader process), and the plain run's loader processes read the same. Both run the recipe
    (``RECIPE``): 1 and 2 replicas mix alike."""
    plain, *_ = fp64_runs
    marker = tmp_path / "fault-marker"
    args = ["pipeline", "--no-use-gpu", "--data", tiny_data, "--model", "resnet18", "--stages", "2",
            "--global-batch-size", "32", "--schedule", "1f1b", "--precision", "fp64", "--balance", "params",
            "--storage-path", str(tmp_path / "runs"), "--log-every", "0", "--augment", *RECIPE]  # fmt: skip
    code, output = run_cli_text(*args, "--name", "change", "--epochs", "2", "--replicas", "1", "--microbatches", "4",
                                "--checkpoint-every-steps", "2",
                                "--inject-fault", f"0:s3:{tmp_path / 'failed'}")  # fmt: skip
    assert code == 1 and "pipeline stage 0 (of stages 0-1) failed" in output, output[-2000:]
    changed = run_cli_json(*args, "--name", "change", "--epochs", "2", "--replicas", "2", "--microbatches", "2",
                           "--max-failures", "1", "--inject-fault", f"2:1:{marker}")  # fmt: skip
    assert marker.read_text() == "killed stage 0 of replica 1 after epoch 1\n"
    assert changed["epochs"] == 2 and changed["num_replicas"] == 2 and len(changed["actors"]) == 4
    assert [(actor["replica"], actor["stage"]) for actor in changed["actors"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert max_diff(plain["model"], changed["model"]) < 1e-9
    assert max_diff(plain["ema"], changed["ema"]) < 1e-9


@pytest.mark.slow  # the fp64 runs
def test_stages_killed_at_the_first_start_and_while_they_are_rebuilt_each_count_as_one_more_failure(fp64_runs):
    """Issue 48's reproduction, on the killed run: a stage actor SIGKILLed from outside as soon as
    it exists, during the first start (retried); a stage killed after a step, before its
    checkpoint; then one of the new stage actors SIGKILLed as soon as it exists, while the stages
    start again: three failures of --max-failures 3, and the model of the uninterrupted run
    (``test_killed_stage_resumes_mid_epoch_from_checkpoint``)."""
    _, _, marker, res, kills = fp64_runs
    assert [why for *_, why in kills] == ["during the first start", "while the stages are rebuilt"], kills
    assert marker.read_text() == "killed stage 1 after step 8\n"
    restarts = [line for line in res.out.splitlines() if "restarting the stages" in line]
    assert len(restarts) == 3, res.out[-3000:]
    failed = f"(of stages 0-1) failed while starting: its actor died: {ABRUPT}"
    assert f"{failed}; restarting the stages from the last checkpoint (1/3)" in restarts[0]
    # Killed after step 8, before its checkpoint: the checkpoint's gathering fails, and the run resumes after step 6.
    assert "failed while gathering the " in restarts[1]
    assert restarts[1].endswith(
        "state: its actor died: killed by ray.kill; restarting the stages from the last checkpoint (2/3)"
    )
    assert "at epoch 2 step 2" in res.out
    assert f"{failed}; restarting the stages from the last checkpoint (3/3)" in restarts[2]
    assert "Unhandled error" not in res.err and "Traceback" not in res.err


@pytest.mark.slow  # a pipeline start
def test_a_stage_killed_during_the_first_start_ends_the_run_in_one_line_without_failures_left(
    ray_session, tiny_data, tmp_path, capfd
):
    """With --max-failures 0; with failures left it is retried (the killed run of ``fp64_runs``)."""
    with Killer("ray::StageWorker") as killer:
        killer.start(lambda: killer.kill_first_new(why="during the first start"))
        res = run_cli(capfd, *fp64_args(tiny_data, str(tmp_path)), "--name", "first", "--max-failures", "0", "--json")
    assert len(killer.kills) == 1, killer.kills
    assert "Unhandled error" not in res.err and "Traceback" not in res.err
    failed = f"(of stages 0-1) failed while starting: its actor died: {ABRUPT}"
    assert res.code == 1
    lines = [line for line in res.err.splitlines() if line.strip() and not RAY_FORWARDED.match(line)]
    assert len(lines) == 1 and lines[0].startswith("raytrain-mp: failed: pipeline stage "), lines
    assert lines[0].endswith(f"{failed} (0 restarts used of --max-failures 0)")
