"""DDP on Ray Train, end to end through `raytrain-mp ddp`: invariances that make it correct.

Each fit costs ~20 s of Ray Train start-up on 2 cores, so runs are module-scoped and shared, and a
run carries several tests' checks where it can:
  fp64 on a 320/80 cut of digits, 2 epochs of 5 steps of 64, every run starting from a weights file
  of another head size (the head replaced by a seeded new one), with --backbone-lr-scale 0.5,
  --bn-momentum 0.2 and an explicit --preprocess: 1 worker | 2 workers --no-sync-bn
  the same with --augment, torchvision's recipe (auto-augment, erasing, mixup/cutmix, label
  smoothing, weight EMA) and loader processes: 1 worker with 2 | 2 workers with 1 each, crashing
  once after step 7 (mid-epoch 2) | 2 workers with 2 each, on a Ray of its own (they reserve 6
  CPUs, the session's Ray has 4 where there is no GPU)
  step checkpoints every 2 steps: 2 workers crashing after step 8 (mid-epoch 2) and restarting
  (also the 2-worker run of the world-size invariance) | 2 workers crashing there with no restart
  left, rerun with 1 worker; these log to MLflow (a real ``mlflow server``), and an eval of the
  rerun adds its outputs there
  one-step synthetic set (val size 25): fp32 on 1 | 2 | 3 workers, fp64 on 1
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raytrain_mp.models import build_model

from helpers import load_model_pt, max_abs_diff, run_cli_json, run_cli_text, timed, write_digits_cut
from mlflow_check import artifacts, assert_tracks_folder, runs_of
from run_log_check import checked_run_log

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]  # fp64 and fp32 DDP runs

# Even float64 training is chaotic: measured here, 1- and 2-worker runs agree to 1e-14 after one
# step, but at peak lr 0.2 differ by 5e-10 of a layer4 running variance after 11 steps and by 3.6e-8
# after 22. At peak lr 0.1 and 10 steps (global batch 256) they agree to 5e-14. The runs here take
# 10 steps of global batch 64 (peak lr 0.025) on a 320/80 cut of digits: half the compute of the
# 640/160 cut at batch 128 they took before, with the same 10 steps and checkpoints. Measured with
# the fine-tuning options below: 1 and 2 workers agree to 7e-15 (also crashed and resumed, also
# with augmentation and loader processes: 1e-14), and without sync BN the 2-worker model differs by
# 1.3 (0.06 in the parameters), augmentation moves it by 1.3: both far from the 1e-9 and 1e-3 bounds.
FP64_ARGS = [
    "--precision",
    "fp64",
    "--epochs",
    "2",
    "--global-batch-size",
    "64",
    "--base-lr",
    "0.1",
    "--seed",
    "3",
    "--log-every",
    "0",
]


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


# The fine-tuning options every fp64 run takes alike, so that each invariance below holds with them
# on: --weights, a state dict of this model with a 7-class head (digits has 10: the head is replaced
# by one initialized from --seed), a lower lr for the backbone, a BatchNorm momentum of 0.2 and an
# explicit --preprocess (resize 8 -> 10, crop 8, the digits' mean/std: the same 8x8 input, so no
# more compute; --preprocess weights would make it 224x224). Not --freeze-backbone: it keeps every
# backbone BatchNorm in eval mode, and the no-sync-bn run would then have nothing to differ by.
WEIGHTS_FILE = "resnet18-7-classes.pt"
PREPROCESS = "resize=10,crop=8,interpolation=bilinear,mean=0.0192,std=0.0238"


def fp64_options(data: str) -> list[str]:
    """The fine-tuning flags of an fp64 run on ``data`` (``fp64_data`` wrote the weights file beside it)."""
    weights = str(Path(data).parent / WEIGHTS_FILE)
    return ["--weights", weights, "--backbone-lr-scale", "0.5", "--bn-momentum", "0.2", "--preprocess", PREPROCESS]


def weights_state() -> dict[str, torch.Tensor]:
    """A seeded resnet18 of the digits' channels and small stem with a 7-class head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return build_model("resnet18", 7, in_channels=1, small_stem=True).state_dict()


@pytest.fixture(scope="module")
def fp64_data(tmp_path_factory) -> str:
    """Digits cut to 320 train / 80 val samples (5 steps of global batch 64 an epoch), with the
    weights file of ``fp64_options`` beside it."""
    data = write_digits_cut(tmp_path_factory.mktemp("digits") / "fp64", 320, 80)
    torch.save(weights_state(), Path(data).parent / WEIGHTS_FILE)
    return data


@pytest.fixture(scope="module")
def fp64_one(ray_session, fp64_data, storage) -> dict:
    """The 1-worker fp64 run, which the others are compared to; alone, for a test that needs only it
    (scripts/gpu_check.sh runs the GPU one with a single CPU fit)."""
    return fp64_fit(storage, fp64_data, "one", "--num-workers", "1")


@pytest.fixture(scope="module")
def fp64_runs(fp64_one, fp64_data, storage):
    two_no_sync = fp64_fit(storage, fp64_data, "two_no_sync", "--num-workers", "2", "--no-sync-bn")
    return {"one": fp64_one, "two_no_sync": two_no_sync, "data": fp64_data}


def fp64_argv(data: str, storage: str, name: str, *extra: str, use_gpu: bool = False) -> list[str]:
    """The ``raytrain-mp`` arguments of an fp64 DDP run on ``data``, named ``name`` under ``storage``."""
    return [
        "ddp",
        "--use-gpu" if use_gpu else "--no-use-gpu",
        "--data",
        data,
        "--storage-path",
        storage,
        "--name",
        name,
        *FP64_ARGS,
        *fp64_options(data),
        *extra,
    ]


def fp64_fit(storage: str, data: str, key: str, *extra: str) -> dict:
    """The JSON result of the fp64 run ``fp64-KEY`` with ``extra`` options."""
    return run_cli_json(*fp64_argv(data, storage, f"fp64-{key}", *extra))


@pytest.fixture(scope="module")
def recipe_crash_marker(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault") / "crashed"


# The recipe runs (--augment, every option of ``RECIPE``, loader processes), a fixture each, so that
# no test's setup starts more than one of them (a test's setup must end within its timeout on a busy
# machine, and CI once spent over 900 s on a setup of four fits).
@pytest.fixture(scope="module")
def recipe_crash(fp64_runs, storage, recipe_crash_marker) -> dict:
    """2 workers with a loader process each, crashing once after global step 7 (mid-epoch 2, resumed
    from the checkpoint at step 6, its loader processes kept across the restart): it carries both
    the loader invariance and the resume after a crash."""
    crash = ["--max-failures", "1", "--checkpoint-every-steps", "2", "--inject-fault", f"1:s7:{recipe_crash_marker}"]
    return fp64_fit(storage, fp64_runs["data"], "two_crash", *RECIPE_FLAGS, "2", "--loader-workers", "1", *crash)


@pytest.fixture(scope="module")
def recipe_two_by_two(fp64_runs, storage) -> dict:
    """2 workers with 2 loader processes each, on a Ray of its own: the uninterrupted run of the
    crashed one's world size."""
    return fit_on_a_larger_ray(
        storage, fp64_runs["data"], "fp64-two-by-two", *RECIPE_FLAGS, "2", "--loader-workers", "2"
    )


@pytest.fixture(scope="module")
def recipe_one_loaders(fp64_runs, storage) -> dict:
    """1 worker with 2 loader processes."""
    return fp64_fit(storage, fp64_runs["data"], "one_loaders", *RECIPE_FLAGS, "1", "--loader-workers", "2")


# torchvision's recipe (issue 49): per-sample auto-augment and random erasing, mixup or cutmix a
# step, label smoothing, a weight average updated every step (decay 0.999, which the reference's
# adjustment makes 0.968 an update at batch 64 over 2 epochs: it visibly lags) and weight decay of
# the BatchNorm parameters and biases; repeated augmentation (each sample read twice an epoch).
RECIPE = [
    "--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
    "--label-smoothing", "0.1", "--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.999",
    "--norm-weight-decay", "0.01", "--ra-sampler", "--ra-reps", "2",
]  # fmt: skip
RECIPE_FLAGS = ["--augment", *RECIPE, "--num-workers"]  # then the worker count


def load_ema_pt(result: dict) -> dict:
    return torch.load(Path(result["ema"]), map_location="cpu", weights_only=True)


def fit_on_a_larger_ray(storage: str, data: str, name: str, *extra: str) -> dict:
    """An fp64 fit on its own local Ray of 6 logical CPUs, in a subprocess: 2 workers of 2 loader
    processes reserve 3 CPUs each, more than the session's Ray has on a CPU machine (4). "local": a
    new Ray even where another runs on this machine (a plain init would join that one through
    /tmp/ray/ray_current_cluster and refuse num_cpus, as conftest's ray_session says)."""
    import json
    import subprocess
    import sys

    code = (
        "import sys, ray\nfrom raytrain_mp.cli import main\n"
        "ray.init(address='local', num_cpus=6, num_gpus=0, include_dashboard=False)\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = [*fp64_argv(data, storage, name, *extra), "--json"]
    with timed(argv):
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))


def test_without_sync_bn_the_model_differs(fp64_runs):
    # The invariance test has teeth: per-rank BatchNorm statistics change the trained model.
    assert max_abs_diff(load_model_pt(fp64_runs["one"]), load_model_pt(fp64_runs["two_no_sync"])) > 1e-3


# The step runs: checkpointed every 2 steps, crashed after global step 8 of 10 (step 3 of epoch 2),
# each logging to MLflow (``MLFLOW_TRACKING_URI``, experiment ``ddp-steps``); the uninterrupted run
# they end as is ``fp64_one``. A fixture each, as the recipe runs above.
STEP_FLAGS = ["--checkpoint-every-steps", "2", "--log-every", "1", "--mlflow", "--mlflow-experiment", "ddp-steps"]


@pytest.fixture(scope="module")
def step_crash(fp64_data, storage, tmp_path_factory, mlflow_server) -> dict:
    """2 workers restarted by Ray Train (also the 2-worker run of test_world_size_invariance_fp64);
    ``marker``: the fault's marker file."""
    marker = tmp_path_factory.mktemp("fault") / "crashed"
    crash = ["--num-workers", "2", *STEP_FLAGS, "--max-failures", "1", "--inject-fault", f"1:s8:{marker}"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        return {**fp64_fit(storage, fp64_data, "two", *crash), "marker": marker}


@pytest.fixture(scope="module")
def step_rerun(fp64_data, storage, tmp_path_factory, mlflow_server) -> dict:
    """2 workers with no restart left (``failed``), rerun with 1 worker (``resumed``): each
    ``run_cli_text``'s (exit code, output)."""
    marker = tmp_path_factory.mktemp("fault") / "crashed"
    crash = ["--num-workers", "2", *STEP_FLAGS, "--inject-fault", f"0:s8:{marker}"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        failed = run_cli_text(*fp64_argv(fp64_data, storage, "fp64-step-crash-w1", *crash))
        resumed = run_cli_text(
            *fp64_argv(fp64_data, storage, "fp64-step-crash-w1", "--num-workers", "1", *STEP_FLAGS, "--json")
        )
    return {"failed": failed, "resumed": resumed}


def test_world_size_invariance_fp64(fp64_one, step_crash):
    """1 worker and 2 train one model. The 2-worker run here is the one that also crashes after step
    8 (test_a_crash_mid_epoch_resumes_at_the_next_step_and_equals_the_uninterrupted_run): one fit
    carries both invariances. An uninterrupted 2-worker run equals the 1-worker run as well in
    test_loader_processes_and_augmentation_keep_both_invariances (two_by_two)."""
    one, two = load_model_pt(fp64_one), load_model_pt(step_crash)
    assert one["conv1.weight"].dtype == torch.float64
    assert max_abs_diff(one, two) < 1e-9
    assert fp64_one["epochs"] == step_crash["epochs"] == 2
    assert step_crash["world_size"] == 2 and step_crash["global_batch_size"] == 64


def test_a_crash_mid_epoch_resumes_at_the_next_step_and_equals_the_uninterrupted_run(fp64_one, step_crash):
    """Compared with the uninterrupted 1-worker run (test_world_size_invariance_fp64 is the same
    comparison; 2 workers crashed after epoch 1 equal 2 uninterrupted ones in
    test_resume_after_crash_equals_uninterrupted_run)."""
    assert step_crash["marker"].read_text() == "rank 1 crashed after step 8\n"
    crashed, uninterrupted = step_crash, fp64_one
    assert crashed["world_size_history"] == [[0, 2], [8, 2]] and crashed["epochs"] == 2
    assert max_abs_diff(load_model_pt(uninterrupted), load_model_pt(crashed)) < 1e-9
    # the epoch's loss counts the 3 steps before the crash once, and not the step after the checkpoint twice
    assert crashed["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=1e-9)


def test_a_crash_mid_epoch_resumes_with_another_world_size(fp64_one, step_rerun, storage):
    code, out = step_rerun["failed"]
    assert code == 1 and "Traceback" not in out.split("raytrain-mp: failed:")[-1]
    failed = (
        "raytrain-mp: failed: ddp worker rank 0 failed: RuntimeError: injected fault: rank 0 after step 8 "
        "(0 restarts used of --max-failures 0)"
    )
    assert failed in out.splitlines(), out[-3000:]
    code, out = step_rerun["resumed"]
    assert code == 0, out[-3000:]
    assert "resumed from" in out and "checkpoint_000002_step_000003 at epoch 2 step 4" in out
    assert "1 worker on 1 node from step 8" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["world_size_history"] == [[0, 2], [8, 1]] and result["world_size"] == 1
    assert max_abs_diff(load_model_pt(fp64_one), load_model_pt(result)) < 1e-9
    assert result["train_loss"] == pytest.approx(fp64_one["train_loss"], rel=1e-9)
    names = sorted(p.name for p in Path(result["run"]).glob("checkpoint_*") if p.is_dir())
    assert names == [
        "checkpoint_000002",
        "checkpoint_000002_step_000003",
    ]  # --num-to-keep 2, step checkpoints named by epoch and step


def test_mlflow_holds_each_run_once_across_a_restart_a_rerun_and_an_eval(
    step_crash, step_rerun, mlflow_server, tmp_path
):
    """--mlflow: the run Ray Train restarted and the run that failed and was rerun are one MLflow
    run each, whose params are the checkpoint's config.yaml and whose metrics are metrics.csv's
    rows, each step once (tests/test_tracking.py: steps logged past the checkpoint); ``eval
    --mlflow`` adds its outputs to the run of the checkpoint's run folder."""
    resumed = json.loads(step_rerun["resumed"][1].strip().splitlines()[-1])
    by_name = {"fp64-two": step_crash, "fp64-step-crash-w1": resumed}
    runs = runs_of(mlflow_server, "ddp-steps")
    assert sorted(run.info.run_name for run in runs) == sorted(by_name)
    out = tmp_path / "eval"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        code, text = run_cli_text(
            "eval", "--checkpoint", resumed["checkpoint"], "--num-workers", "1", "--no-use-gpu", "--out", str(out),
            "--mlflow", "--mlflow-experiment", "ddp-steps",
        )  # fmt: skip
    assert code == 0, text[-3000:]
    runs = runs_of(mlflow_server, "ddp-steps")
    assert len(runs) == 2
    for run in runs:
        result = by_name[run.info.run_name]
        # MLflow params cannot change: the rerun's run keeps the options it started with
        started_with = {"num_workers": "2"} if result is resumed else None
        assert_tracks_folder(mlflow_server, run, result["run"], result["checkpoint"], started_with)
    (crashed,) = [run for run in runs if run.info.run_name == "fp64-step-crash-w1"]
    assert artifacts(mlflow_server, crashed.info.run_id, "eval/eval") == {
        f"eval/eval/{name}" for name in ("eval.json", "confusion.png", "predictions.csv")
    }


def test_the_recipe_run_crashed_once_and_ended(recipe_crash, recipe_crash_marker):
    assert recipe_crash_marker.read_text() == "rank 1 crashed after step 7\n"
    assert recipe_crash["epochs"] == 2 and recipe_crash["world_size"] == 2
    assert recipe_crash["world_size_history"] == [[0, 2], [6, 2]]  # resumed at step 6's checkpoint


def test_the_run_log_continues_at_the_checkpoint_without_duplicated_or_missing_steps(
    fp64_one, step_crash, step_rerun, recipe_crash
):
    """Crashed after step 8 and resumed from the checkpoint after it (by Ray Train, or by a rerun of
    the name with another world size), every step and epoch is logged once, in metrics.csv and in
    the TensorBoard events; the epochs' numbers are the uninterrupted run's."""
    resumed = json.loads(step_rerun["resumed"][1].strip().splitlines()[-1])
    one = checked_run_log(fp64_one["run"], steps=10, epochs=2, steps_per_epoch=5, log_every=0)
    for run in (step_crash, resumed):
        rows = checked_run_log(run["run"], steps=10, epochs=2, steps_per_epoch=5)
        epochs = [r for r in rows if r["kind"] == "epoch"]
        for name in ("train_loss", "val_loss", "val_accuracy", "lr"):
            assert [float(r[name]) for r in epochs] == pytest.approx([float(r[name]) for r in one], rel=1e-9)
    crash_after_epoch = checked_run_log(recipe_crash["run"], steps=10, epochs=2, steps_per_epoch=5, log_every=0)
    assert crash_after_epoch[-1]["val_accuracy"] == repr(recipe_crash["val_accuracy"])


def test_resume_after_crash_equals_uninterrupted_run(recipe_crash, recipe_two_by_two):
    """2 workers (augmented with the recipe, a loader process each) crash after global step 7 and
    resume at step 6's checkpoint: the model and its weight average are the uninterrupted 2-worker
    run's (with 2 loader processes each, which
    test_loader_processes_and_augmentation_keep_both_invariances shows changes nothing)."""
    crashed, uninterrupted = recipe_crash, recipe_two_by_two
    assert max_abs_diff(load_model_pt(uninterrupted), load_model_pt(crashed)) < 1e-9
    assert max_abs_diff(load_ema_pt(uninterrupted), load_ema_pt(crashed)) < 1e-9


def test_loader_processes_and_augmentation_keep_both_invariances(
    fp64_one, recipe_one_loaders, recipe_two_by_two, recipe_crash
):
    """1 worker with 2 loader processes, 2 workers with 2 each, and 2 workers with 1 each (the run
    that also crashed once: test_resume_after_crash_equals_uninterrupted_run) train one model and
    one weight average, with every option of the recipe on."""
    one_run = recipe_one_loaders
    one, one_ema = load_model_pt(one_run), load_ema_pt(one_run)
    assert recipe_two_by_two["world_size"] == recipe_crash["world_size"] == 2
    for run in (recipe_two_by_two, recipe_crash):
        assert max_abs_diff(one, load_model_pt(run)) < 1e-9
        assert max_abs_diff(one_ema, load_ema_pt(run)) < 1e-9
        assert run["val_accuracy_ema"] == one_run["val_accuracy_ema"]
    assert max_abs_diff(one, load_model_pt(fp64_one)) > 1e-3  # augmentation did change the batches
    assert max_abs_diff(one, one_ema) > 1e-3  # the average is not the model
    # the optimizer the workers built: conv/linear weights at --weight-decay, the rest at --norm-weight-decay
    state = torch.load(Path(one_run["checkpoint"]) / "train_state.pt", map_location="cpu", weights_only=False)
    decays = {round(group["weight_decay"], 12) for group in state["optimizer"]["param_groups"]}
    assert decays == {5e-4, 0.01}, decays


def test_model_pt_loads_strict_into_plain_model(step_crash):
    model = build_model("resnet18", 10, in_channels=1, small_stem=True)
    state = load_model_pt(step_crash)  # 2 workers: the model was wrapped in DDP
    assert not any(k.startswith("module.") for k in state)
    model.load_state_dict(state, strict=True)
    assert step_crash["val_count"] == 80


@pytest.fixture(scope="module")
def one_step_data(tmp_path_factory) -> str:
    """64 train samples (one global batch: one optimizer step per epoch) and 25 val samples."""
    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import make_synthetic_source

    out = tmp_path_factory.mktemp("onestep") / "d"
    raw = make_synthetic_source(89, 8, 4, 1, 25 / 89, 3)
    assert (len(raw.train.labels), len(raw.val.labels)) == (64, 25)
    write_dataset(raw, out)
    return str(out)


def one_step_argv(data: str, storage: str, workers: int, *extra: str) -> list[str]:
    """The ``raytrain-mp`` arguments of a one-step run on ``data`` with ``workers`` workers."""
    return ["ddp", "--data", data, "--epochs", "1", "--global-batch-size", "48", "--warmup-epochs", "0",
            "--lr-decay", "none", "--storage-path", storage, "--log-every", "0", "--no-use-gpu",
            "--num-workers", str(workers), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def one_step_runs(one_step_data, storage):
    runs = {w: run_cli_json(*one_step_argv(one_step_data, storage, w, "--name", f"onestep-{w}")) for w in (1, 2, 3)}
    runs["fp64"] = run_cli_json(
        *one_step_argv(one_step_data, storage, 1, "--precision", "fp64", "--name", "onestep-fp64")
    )
    return {**runs, "data": one_step_data}


def test_first_step_agrees_in_fp32(one_step_runs):
    """One fp32 step on 1, 2 or 3 workers lands where exact arithmetic (the fp64 step) lands.

    Why this data seed: a float32 pre-activation within rounding (~1e-7) of zero can take the other
    side of a ReLU than in float64, and that one element moves this ResNet's gradient by ~1e-3.
    Measured in one process (fp32 vs fp64 gradient, 6 batch shapes): 1.7e-6 or less with no sign
    flip, 8e-4 to 7e-3 with one or two, and nothing in between. With data seed 5 the 2-worker run
    (per-rank batch 24, a different conv kernel) hit one flip (1.9e-4 from the fp64 step) while 1 and
    3 workers agreed to 1.6e-7; seed 1 hit one (1.0e-4) once the validation split became stratified
    (other samples in train); with seed 3 no run hits one. A distribution bug (a gradient not
    averaged, a sample counted twice, BatchNorm statistics not synchronized) moves the step by far
    more than 1e-5."""
    exact = load_model_pt(one_step_runs["fp64"])
    assert exact["fc.weight"].dtype == torch.float64
    torch.manual_seed(0)  # the trainer's seeded init, before its one step
    assert max_abs_diff(exact, build_model("resnet18", 4, 1, True).state_dict()) > 1e-2  # it did move
    steps = {workers: load_model_pt(one_step_runs[workers]) for workers in (1, 2, 3)}
    for workers, step in steps.items():
        assert step["fc.weight"].dtype == torch.float32
        assert max_abs_diff(step, exact) < 1e-5, workers
        assert max_abs_diff(step, steps[1]) < 1e-5, workers


def test_evaluation_counts_every_val_sample_once(one_step_runs):
    for workers in (1, 2, 3):
        assert one_step_runs[workers]["val_count"] == 25  # 25 is divisible by neither 2 nor 3
    accuracies = {round(one_step_runs[w]["val_accuracy"], 12) for w in (1, 2, 3)}
    assert len(accuracies) == 1


@pytest.mark.gpu(1)
def test_gpu_ddp_with_nccl_native_syncbn_and_fp16(digits_dir, storage):
    workers = min(2, torch.cuda.device_count())
    result = run_cli_json(
        "ddp", "--use-gpu", "--num-workers", str(workers), "--precision", "fp16", "--epochs", "1",
        "--global-batch-size", "128", "--storage-path", storage, "--name", "gpu", "--log-every", "0",
    )  # fmt: skip
    assert result["world_size"] == workers and result["val_count"] == 359
    build_model("resnet18", 10, 1, True).load_state_dict(load_model_pt(result), strict=True)


@pytest.mark.gpu(1)
def test_gpu_fp64_run_equals_the_cpu_run(fp64_one, fp64_data, storage):
    """The CUDA path (NCCL group, native SyncBatchNorm on one rank, cuDNN) computes the same
    training as the CPU path: compared in float64, where TF32 and summation order cannot hide a bug."""
    gpu = run_cli_json(*fp64_argv(fp64_data, storage, "fp64-gpu", "--num-workers", "1", use_gpu=True))
    assert max_abs_diff(load_model_pt(gpu), load_model_pt(fp64_one)) < 1e-9


def test_checkpoints_are_named_by_epoch_and_the_lr_is_the_last_steps(fp64_runs):
    from raytrain_mp.lr_schedule import make_schedule

    result = fp64_runs["one"]
    assert Path(result["checkpoint"]).name == "checkpoint_000002"  # as the pipeline names them
    assert sorted(p.name for p in Path(result["run"]).glob("checkpoint_*") if p.is_dir()) == [
        "checkpoint_000001",
        "checkpoint_000002",
    ]
    # 320 training samples, global batch 64: 5 steps an epoch; the reported lr is the 10th step's, not 0.
    schedule = make_schedule(0.1, 64, 256, "linear", 1.0, 2, 5, "cosine", 30, 0.1)
    assert result["lr"] == pytest.approx(schedule(9), rel=1e-12) and result["lr"] > 0


def test_rerun_of_a_finished_run_prints_its_summary_without_ray(one_step_runs, storage):
    """As a user reruns it: a new process; nothing but the JSON line (no Ray started, no epoch). A
    run without --weights: with a weights file the driver says its head's line before it finds the
    run finished (the fp64 runs')."""
    import subprocess

    argv = one_step_argv(one_step_runs["data"], storage, 2, "--name", "onestep-2", "--json")
    done = subprocess.run(["raytrain-mp", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == json.loads(json.dumps(one_step_runs[2]))


def test_the_fp64_runs_start_from_the_weights_file_with_a_new_seeded_head(fp64_runs):
    """What every fp64 run's workers built before their first step, from the run's own config.yaml
    (seeded as ddp.loop.build_ddp seeds it): the file's backbone, unchanged, a new 10-class head,
    BatchNorm momentum 0.2; and the fine-tuning options reached the run."""
    from raytrain_mp.config import build_config
    from raytrain_mp.data import read_meta
    from raytrain_mp.ddp.config import DDPConfig
    from raytrain_mp.epochs import build_run_model

    cfg = build_config(DDPConfig, {"config": str(Path(fp64_runs["one"]["checkpoint"]) / "config.yaml")})
    assert cfg.weights == str(Path(fp64_runs["data"]).parent / WEIGHTS_FILE) and cfg.preprocess == PREPROCESS
    assert (cfg.backbone_lr_scale, cfg.bn_momentum, cfg.freeze_backbone) == (0.5, 0.2, False)
    torch.manual_seed(cfg.seed)
    model = build_run_model(cfg, read_meta(fp64_runs["data"]))
    start, weights = model.state_dict(), weights_state()
    assert all(torch.equal(start[k], v) for k, v in weights.items() if not k.startswith("fc."))
    assert start["fc.weight"].shape == (10, 512)
    assert {m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.2}
