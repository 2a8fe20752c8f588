"""`raytrain-mp tune` without Ray: the sweep config, its bad inputs, and the report it writes."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import yaml

from raytrain_mp.config import build_config
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.errors import UsageError
from raytrain_mp.lr_schedule import scaled_lr
from raytrain_mp.tune.config import (
    DEFAULT_BASE_LRS,
    DEFAULT_NUM_SAMPLES,
    NOT_PASSED_ON,
    PER_TRIAL,
    TuneConfig,
    concurrency,
    trial_config,
    trials_that_fit,
    tune_config_from_args,
)
from raytrain_mp.tune.report import COLUMNS, TrialOutcome, best_row, table_rows, write_outputs

from helpers import assert_usage_error, run_cli, run_without


def make(tmp_path, **flags) -> TuneConfig:
    return build_config(TuneConfig, {"storage_path": str(tmp_path / "runs"), "num_workers": "1", **flags})


def test_every_other_ddp_option_is_a_sweep_option_with_the_same_definition():
    ddp = {f.name: f for f in dataclasses.fields(DDPConfig)}
    sweep = {f.name: f for f in dataclasses.fields(TuneConfig)}
    for name, f in ddp.items():
        if name in PER_TRIAL + NOT_PASSED_ON:
            continue
        assert sweep[name].default == f.default and sweep[name].metadata == f.metadata, name
    assert not set(PER_TRIAL) & set(sweep)  # one value per trial comes from the search space, never a flag


def test_grids_from_flags_and_yaml(tmp_path):
    cfg = make(
        tmp_path,
        base_lrs="0.1, 0.2,0.4",
        global_batch_sizes="32,64",
        optimizers="sgd,adamw",
        warmup_epochs_grid="0,1",
        weight_decays="1e-4,5e-5",
        label_smoothings="0,0.1",
    )
    assert cfg.grid() == {
        "global_batch_size": (32, 64),
        "optimizer": ("sgd", "adamw"),
        "warmup_epochs": (0.0, 1.0),
        "weight_decay": (1e-4, 5e-5),
        "label_smoothing": (0.0, 0.1),
        "base_lr": (0.1, 0.2, 0.4),
    }
    assert cfg.num_trials() == 96
    single = make(tmp_path, base_lrs="0.3", global_batch_sizes="128")
    assert (single.grid()["base_lr"], single.grid()["global_batch_size"]) == ((0.3,), (128,))
    path = tmp_path / "sweep.yaml"
    path.write_text("base-lrs: [0.05, 0.1]\nglobal_batch_sizes: 64\nlr_rule: none\nepochs: 3\n")
    from_yaml = build_config(TuneConfig, {"config": str(path), "storage_path": str(tmp_path), "epochs": "4"})
    assert from_yaml.grid()["base_lr"] == (0.05, 0.1) and from_yaml.global_batch_sizes == (64,)
    assert (from_yaml.lr_rule, from_yaml.epochs) == ("none", 4)  # flag wins over YAML


def test_defaults_and_log_uniform(tmp_path):
    cfg = make(tmp_path)
    assert cfg.grid()["base_lr"] == DEFAULT_BASE_LRS and cfg.num_trials() == len(DEFAULT_BASE_LRS) * 2
    assert (cfg.mode, cfg.scheduler, cfg.optimizers, cfg.warmup_epochs_grid) == ("max", "asha", ("sgd",), (1.0,))
    assert (cfg.weight_decays, cfg.label_smoothings) == ((DDPConfig.weight_decay,), (DDPConfig.label_smoothing,))
    sampled = make(tmp_path, lr_min="0.01", lr_max="1", num_samples="5", metric="val_loss", seed="3")
    lrs = sampled.grid()["base_lr"]
    assert len(lrs) == 5 and list(lrs) == sorted(lrs) and all(0.01 <= lr <= 1 for lr in lrs)
    assert sampled.num_trials() == 10 and sampled.mode == "min"
    assert make(tmp_path, lr_min="0.01", lr_max="1", num_samples="5", seed="3").grid()["base_lr"] == lrs  # seeded
    assert make(tmp_path, lr_min="0.01", lr_max="1", num_samples="5", seed="4").grid()["base_lr"] != lrs
    assert len(make(tmp_path, lr_min="0.01", lr_max="1").grid()["base_lr"]) == DEFAULT_NUM_SAMPLES


def test_trial_config_is_the_template_at_a_point(tmp_path):
    cfg = make(tmp_path, global_batch_sizes="64,128", epochs="3", lr_rule="sqrt", seed="7")
    point = {
        "base_lr": 0.2, "global_batch_size": 128, "optimizer": "adamw", "warmup_epochs": 0.5, "weight_decay": 0.05,
        "label_smoothing": 0.1,
    }  # fmt: skip
    trial = trial_config(cfg.template(), point, name="t")
    assert isinstance(trial, DDPConfig)
    assert {name: getattr(trial, name) for name in point} == point
    assert (trial.epochs, trial.lr_rule, trial.seed, trial.num_workers, trial.name) == (3, "sqrt", 7, 1, "t")
    with pytest.raises(ValueError, match="not per-trial"):
        trial_config(cfg.template(), {"epochs": 9})


BAD = [
    (["--base-lrs="], ["--base-lrs: the grid is empty"]),
    (["--global-batch-sizes="], ["--global-batch-sizes: the grid is empty"]),
    (["--optimizers="], ["--optimizers: the grid is empty"]),
    (["--warmup-epochs-grid="], ["--warmup-epochs-grid: the grid is empty"]),
    (["--base-lrs", "0.1,0"], ["--base-lrs: must be finite numbers > 0, got 0.0"]),
    (["--base-lrs=-0.1"], ["--base-lrs: must be finite numbers > 0, got -0.1"]),
    (["--base-lrs", "0.1,fast"], ["--base-lrs: expected float, got 'fast'"]),
    (["--base-lrs", "nan"], ["--base-lrs: must be finite numbers > 0"]),
    (["--global-batch-sizes", "64,0"], ["--global-batch-sizes: must be >= 1, got 0"]),
    (["--global-batch-sizes=-64"], ["--global-batch-sizes: must be >= 1, got -64"]),
    (
        ["--global-batch-sizes", "64,100", "--num-workers", "3"],
        ["--global-batch-sizes: 64 is not divisible by --num-workers 3; accepted: a multiple of 3"],
    ),
    (
        ["--global-batch-sizes", "64", "--num-workers", "2", "--grad-accum-steps", "3"],
        [
            "--global-batch-sizes: 64 is not divisible by --num-workers 2 x --grad-accum-steps 3; accepted: a multiple "
            "of 6"
        ],
    ),
    (
        ["--num-workers", "1-2", "--max-failures", "1"],
        ["--num-workers: a sweep's trials run at one size; accepted: a worker count, got 1-2"],
    ),
    (["--checkpoint-every-steps", "2"], ["unrecognized arguments: --checkpoint-every-steps"]),
    (["--global-batch-sizes", "64.5"], ["--global-batch-sizes: expected int, got '64.5'"]),
    (["--lr-min", "0", "--lr-max", "1"], ["--lr-min: must be a finite number > 0, got 0.0"]),
    (["--lr-min", "0.5", "--lr-max", "0.1"], ["--lr-max: must be > --lr-min 0.5, got 0.1"]),
    (["--lr-min", "0.1"], ["--lr-min: --lr-min and --lr-max go together"]),
    (["--lr-min", "0.1", "--lr-max", "1", "--base-lrs", "0.2"], ["--base-lrs: give either a grid", "not both"]),
    (["--lr-min", "0.1", "--lr-max", "1", "--num-samples", "0"], ["--num-samples: must be >= 1, got 0"]),
    (["--num-samples", "4"], ["--num-samples: a grid tries each value once; accepted: --num-samples with --search"]),
    (["--search", "random", "--num-samples", "0", "--base-lrs", "0.1,0.2"], ["--num-samples: must be >= 1, got 0"]),
    (["--search", "bayes"], ["--search", "invalid choice: 'bayes'"]),
    (
        ["--search", "optuna", "--global-batch-sizes", "64", "--base-lrs", "0.1"],
        ["--search: optuna: nothing to choose, every grid has one value"],
    ),
    (
        ["--scheduler", "pbt", "--base-lrs", "0.1", "--epochs", "3"],
        ["--scheduler: pbt perturbs the lr and the weight decay, and neither varies"],
    ),
    (
        ["--scheduler", "pbt", "--lr-min", "0.1", "--lr-max", "1", "--epochs", "1"],
        ["--perturbation-interval: must be in [1, --epochs 1)"],
    ),
    (["--perturbation-interval", "2"], ["--perturbation-interval: only with --scheduler pbt, got --scheduler asha"]),
    (
        ["--scheduler", "pbt", "--base-lrs", "0.1,0.2", "--grace-period", "2"],
        ["--grace-period: only with --scheduler asha, got --scheduler pbt"],
    ),
    (
        ["--scheduler", "none", "--reduction-factor", "3"],
        ["--reduction-factor: only with --scheduler asha, got --scheduler none"],
    ),
    (["--optimizers", "sgd,lamb"], ["--optimizers: unknown value 'lamb'", "sgd, adamw"]),
    (["--warmup-epochs-grid", "1,-1"], ["--warmup-epochs-grid: must be >= 0, got -1.0"]),
    (["--weight-decays="], ["--weight-decays: the grid is empty"]),
    (["--weight-decays", "1e-4,-1e-4"], ["--weight-decays: must be >= 0, got -0.0001"]),
    (["--label-smoothings="], ["--label-smoothings: the grid is empty"]),
    (["--label-smoothings", "0,1"], ["--label-smoothings: must be in [0, 1), got 1.0"]),
    (["--scheduler", "hyperband"], ["--scheduler", "invalid choice: 'hyperband'"]),
    (["--metric", "train_loss"], ["--metric", "invalid choice: 'train_loss'"]),
    (["--grace-period", "3", "--epochs", "2"], ["--grace-period: must be in [1, --epochs 2], got 3"]),
    (["--reduction-factor", "1"], ["--reduction-factor: must be > 1"]),
    (["--max-concurrent-trials", "0"], ["--max-concurrent-trials: must be >= 1, got 0"]),
    (["--epochs", "0", "--grace-period", "1"], ["--grace-period: must be in [1, --epochs 0]"]),
    (["--cpus-per-worker", "0"], ["--cpus-per-worker: must be >= 1, got 0"]),  # a DDP option, checked as ddp checks it
    (["--precision", "fp16", "--no-use-gpu"], ["--precision: fp16 needs CUDA"]),
    (["--resume", "/no/such/sweep"], ["--resume: /no/such/sweep holds no sweep.yaml"]),
]


@pytest.mark.parametrize("argv, fragments", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options(tmp_path, capsys, argv, fragments):
    runs = tmp_path / "runs"
    res = run_cli(capsys, "tune", "--storage-path", str(runs), "--num-workers", "1", *argv)
    assert_usage_error(res, *fragments)
    assert not runs.exists()  # nothing started, nothing written


def test_resume_takes_no_other_options(tmp_path, capsys):
    (tmp_path / "sweep.yaml").write_text("epochs: 2\n")
    res = run_cli(capsys, "tune", "--resume", str(tmp_path), "--epochs", "3", "--base-lrs", "0.1")
    assert_usage_error(res, "--resume takes every option from", "drop --base-lrs, --epochs")
    cfg = tune_config_from_args({"resume": str(tmp_path), "json": True, "address": "auto"})
    assert (cfg.epochs, cfg.resume, cfg.address) == (2, str(tmp_path.resolve()), "auto")


def test_batch_larger_than_the_data_set(tmp_path, capsys, digits_dir):
    res = run_cli(
        capsys,
        "tune",
        "--storage-path",
        str(tmp_path / "runs"),
        "--global-batch-sizes",
        "64,4096",
        "--num-workers",
        "1",
    )
    assert_usage_error(res, "--global-batch-sizes: 4096 exceeds the", "training samples")
    assert not (tmp_path / "runs").exists()


def test_existing_experiment_is_not_overwritten(tmp_path, capsys, digits_dir):
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    res = run_cli(capsys, "tune", "--storage-path", str(tmp_path / "runs"), "--name", "mine", "--num-workers", "1")
    assert_usage_error(res, "--name:", "mine exists; finish it with --resume")


def test_trials_that_fit_counts_the_driver_and_the_workers(tmp_path):
    assert trials_that_fit(4, 0, 1, 1, use_gpu=False) == 2  # (1 driver + 1 worker) CPUs each
    assert trials_that_fit(16, 0, 2, 2, use_gpu=False) == 3
    assert trials_that_fit(16, 8, 1, 1, use_gpu=True) == 8
    assert trials_that_fit(16, 8, 3, 1, use_gpu=True) == 2  # GPUs bound it
    with pytest.raises(
        UsageError,
        match=r"--num-workers 4: a trial needs 5 CPUs \(1 for its driver \+ 4 x --cpus-per-worker 1\) "
        r"but the Ray cluster has 4; accepted: at most 3 workers",
    ):
        trials_that_fit(4, 0, 4, 1, use_gpu=False)
    with pytest.raises(UsageError, match="--num-workers 2: a trial needs 2 GPUs but the Ray cluster has 1"):
        trials_that_fit(8, 1, 2, 1, use_gpu=True)
    cfg = make(tmp_path, max_concurrent_trials="3")
    with pytest.raises(UsageError, match="--max-concurrent-trials: 3 trials do not fit .* at most 2"):
        concurrency(cfg, 4, 0, use_gpu=False)
    assert concurrency(make(tmp_path, max_concurrent_trials="1"), 4, 0, use_gpu=False) == 1
    assert concurrency(make(tmp_path), 4, 0, use_gpu=False) == 2


# ---------------------------------------------------------------------------------------------
# The report, from hand-made trial outcomes.


def epochs(*accuracies: float, start: int = 1) -> list[dict]:
    return [
        {"epoch": start + i, "val_accuracy": a, "val_loss": 1 - a, "world_size": 1} for i, a in enumerate(accuracies)
    ]


def point(lr: float, batch: int) -> dict:
    return {"base_lr": lr, "global_batch_size": batch, "optimizer": "sgd", "warmup_epochs": 1.0}


@pytest.fixture
def outcomes() -> list[TrialOutcome]:
    return [
        TrialOutcome("t0", point(0.1, 64), epochs(0.5, 0.7)),
        TrialOutcome("t1", point(0.4, 64), epochs(0.6, 0.9)),
        TrialOutcome("t2", point(0.1, 128), epochs(0.4)),  # stopped by ASHA after epoch 1
        TrialOutcome("t3", point(0.4, 128), epochs(0.6) + epochs(0.8, 0.95, start=1)),  # rerun after a resume
        TrialOutcome("t4", point(1.6, 128), [], "Traceback ...\nFloatingPointError: non-finite metrics"),
    ]


def test_table_rows(tmp_path, outcomes):
    template = make(tmp_path, epochs="2", lr_rule="linear").template()
    rows = {r["trial"]: r for r in table_rows(outcomes, template)}
    assert [r["trial"] for r in table_rows(outcomes, template)] == ["t0", "t1", "t2", "t3", "t4"]
    for r in rows.values():
        assert list(r) == COLUMNS.names
        assert r["effective_lr"] == scaled_lr(r["base_lr"], r["global_batch_size"], 256, "linear")
    assert (rows["t1"]["best_val_accuracy"], rows["t1"]["epochs_run"]) == (0.9, 2)
    assert math.isclose(rows["t1"]["best_val_loss"], 0.1) and rows["t1"]["status"] == "completed"
    assert (rows["t2"]["status"], rows["t2"]["epochs_run"], rows["t2"]["final_val_accuracy"]) == ("stopped", 1, 0.4)
    assert (rows["t3"]["final_val_accuracy"], rows["t3"]["best_val_accuracy"], rows["t3"]["status"]) == (
        0.95,
        0.95,
        "completed",
    )
    assert rows["t4"]["status"] == "error" and rows["t4"]["error"] == "FloatingPointError: non-finite metrics"
    assert rows["t4"]["best_val_accuracy"] is None and rows["t4"]["epochs_run"] == 0
    none_rule = make(tmp_path, lr_rule="none").template()
    assert all(r["effective_lr"] == r["base_lr"] for r in table_rows(outcomes, none_rule))
    assert best_row(list(rows.values()), "val_accuracy", "max")["trial"] == "t3"
    assert best_row(list(rows.values()), "val_loss", "min")["trial"] == "t3"
    assert best_row([rows["t4"]], "val_accuracy", "max") is None


def test_outputs_table_plot_and_best_yaml(tmp_path, outcomes):
    template = make(tmp_path, epochs="2", seed="5").template()
    rows = table_rows(outcomes, template)
    out = write_outputs(rows, template, "val_accuracy", "max", str(tmp_path / "exp"))
    assert out["best"]["trial"] == "t3"
    for table in (pq.read_table(out["table_parquet"]), pa_csv.read_csv(out["table_csv"])):
        assert table.num_rows == 5 and table.column_names == COLUMNS.names
        assert table.column("base_lr").to_pylist() == [0.1, 0.4, 0.1, 0.4, 1.6]
    assert pq.read_table(out["table_parquet"]).schema == COLUMNS
    with open(out["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    best = build_config(DDPConfig, {"config": out["best_yaml"]})  # what `raytrain-mp ddp --config` does
    assert (best.base_lr, best.global_batch_size, best.seed, best.epochs, best.name) == (0.4, 128, 5, 2, None)
    assert best.storage_path == DDPConfig.storage_path  # where the sweep wrote is not what it chose
    assert Path(out["best_yaml"]).read_text().startswith("# Best trial of the sweep")


def test_best_yaml_holds_what_the_sweep_chose_not_this_machine(tmp_path, outcomes, digits_dir):
    """Prepared as `raytrain-mp tune` prepares it: no --data (the built-in digits, cached here)."""
    from raytrain_mp.tune.sweep import prepared

    cfg = prepared(make(tmp_path, epochs="2", seed="5", optimizers="sgd,adamw", log_every="0", inject_fault="0:1:x"))
    assert cfg.data is None  # what the user gave: sweep.yaml and best.yaml stay free of the cache folder
    # The trials' template as run_sweep resolves it on a CPU-only cluster.
    trials = dataclasses.replace(cfg.template(), use_gpu=False, data=digits_dir, name=None)
    rows = table_rows(outcomes, trials)
    out = write_outputs(rows, cfg.template(), "val_accuracy", "max", str(tmp_path / "exp"))
    text = Path(out["best_yaml"]).read_text()
    assert text.startswith(f"# Best trial of the sweep {tmp_path / 'exp'}: t3\n")
    chosen = {
        "model": "resnet18",
        "epochs": 2,
        "base_lr": 0.4,
        "warmup_epochs": 1.0,
        "optimizer": "sgd",
        "weight_decay": DDPConfig.weight_decay,
        "seed": 5,
        "log_every": 0,
        "label_smoothing": 0.0,
        "num_workers": 1,
        "global_batch_size": 128,
    }
    assert yaml.safe_load(text) == chosen and list(yaml.safe_load(text)) == list(chosen)  # DDPConfig's field order
    # The same from a template that already holds machine state: none of it leaks.
    resolved = dataclasses.replace(
        cfg.template(), use_gpu=False, address="auto", name="run", resume_from="/ckpt", verbose=True
    )
    again = write_outputs(rows, resolved, "val_accuracy", "max", str(tmp_path / "again"))
    assert yaml.safe_load(Path(again["best_yaml"]).read_text()) == chosen
    # Data the user gave is kept, made absolute (best.yaml is run from any folder).
    given = prepared(make(tmp_path, data=os.path.relpath(digits_dir), epochs="2", name="given"))
    with_data = write_outputs(rows, given.template(), "val_accuracy", "max", str(tmp_path / "with-data"))
    assert yaml.safe_load(Path(with_data["best_yaml"]).read_text()) == {
        "data": digits_dir,
        "model": "resnet18",
        "epochs": 2,
        "base_lr": 0.4,
        "warmup_epochs": 1.0,
        "optimizer": "sgd",
        "weight_decay": DDPConfig.weight_decay,
        "label_smoothing": 0.0,
        "num_workers": 1,
        "global_batch_size": 128,
    }


def test_all_trials_failed_writes_the_table_but_no_best(tmp_path):
    template = make(tmp_path).template()
    rows = table_rows([TrialOutcome("t0", point(0.1, 64), [], "boom")], template)
    out = write_outputs(rows, template, "val_accuracy", "max", str(tmp_path / "exp"))
    assert out["best"] is None and out["best_yaml"] is None
    assert pq.read_table(out["table_parquet"]).column("status").to_pylist() == ["error"]


def test_random_and_optuna_search_spaces_and_what_pbt_perturbs(tmp_path):
    from ray.tune.search.sample import Categorical, Float

    from raytrain_mp.tune.search import optuna_population, param_space, scheduler, search_alg

    grid = make(tmp_path, base_lrs="0.1,0.2", weight_decays="0,1e-4", epochs="3")
    assert grid.num_trials() == 8 and search_alg(grid, 2) is None
    assert param_space(grid)["base_lr"] == {"grid_search": [0.1, 0.2]}
    ranged = make(tmp_path, search="random", lr_min="0.01", lr_max="1", num_samples="5", epochs="3")
    space = param_space(ranged)
    assert ranged.num_trials() == 5 and set(ranged.varying()) == {"global_batch_size", "base_lr"}
    assert isinstance(space["base_lr"], Float) and (space["base_lr"].lower, space["base_lr"].upper) == (0.01, 1)
    assert isinstance(space["global_batch_size"], Categorical) and space["global_batch_size"].categories == [64, 128]
    assert (space["optimizer"], space["weight_decay"]) == ("sgd", DDPConfig.weight_decay)  # one value: fixed
    assert search_alg(ranged, 2).max_concurrent == 2  # Tune would not apply max_concurrent_trials to it
    pbt = make(tmp_path, search="optuna", scheduler="pbt", lr_min="0.01", lr_max="1", weight_decays="0,1e-4",
               global_batch_sizes="64", num_samples="4", epochs="3", seed="7")  # fmt: skip
    assert set(pbt.perturbed()) == {"base_lr", "weight_decay"}
    mutations = scheduler(pbt)._hyperparam_mutations
    assert set(mutations) == {"base_lr", "weight_decay"} and mutations["weight_decay"].categories == [0.0, 1e-4]
    # Tune's PBT refuses a search algorithm: Optuna's seeded QMC draws the starting population instead
    population = optuna_population(pbt)
    assert len(population) == 4 and population == optuna_population(pbt)
    assert all(set(p) == {"base_lr", "weight_decay"} and 0.01 <= p["base_lr"] <= 1 for p in population)
    assert population != optuna_population(make(tmp_path, **{**vars_of(pbt), "seed": "8"}))
    assert search_alg(pbt, 1)._points_to_evaluate == population


def vars_of(cfg) -> dict[str, str]:
    return dict(search=cfg.search, scheduler=cfg.scheduler, lr_min=str(cfg.lr_min), lr_max=str(cfg.lr_max),
                weight_decays="0,1e-4", global_batch_sizes="64", num_samples="4", epochs="3")  # fmt: skip


def test_optuna_missing_is_one_line_before_anything_runs(tmp_path):
    argv = ["tune", "--search", "optuna", "--lr-min", "0.1", "--lr-max", "1", "--storage-path", str(tmp_path / "runs")]
    done = run_without("optuna", *argv)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.strip().splitlines() == [
        "raytrain-mp: error: --search: optuna needs Optuna, which is not installed; accepted: pip install "
        "'raytrain_mp[optuna]', or grid, random"
    ]
    assert not (tmp_path / "runs").exists()
