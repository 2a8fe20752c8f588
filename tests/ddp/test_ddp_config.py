"""`raytrain-mp ddp` bad inputs: one line naming the option, exit code 2, no worker started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import assert_usage_error, run_cli, session_cpus, session_gpus


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["--global-batch-size", "63"],
            ["--global-batch-size: 63 is not divisible by --num-workers 2", "multiple of 2"],
        ),
        (
            ["--global-batch-size", "64", "--num-workers", "2", "--grad-accum-steps", "3"],
            ["x --grad-accum-steps 3", "multiple of 6"],
        ),
        (
            ["--model", "vgg 16"],
            ["--model: 'vgg 16' is neither a torchvision model name (e.g. resnet18) nor package.module:callable"],
        ),
        (["--optimizer", "lamb"], ["--optimizer", "invalid choice: 'lamb'", "sgd", "adamw"]),
        (["--base-lr", "0"], ["--base-lr: must be > 0, got 0.0"]),
        (["--base-lr=-1e-3"], ["--base-lr: must be > 0, got -0.001"]),
        (["--base-lr", "fast"], ["--base-lr: expected float, got 'fast'"]),
        (["--epochs", "0"], ["--epochs: must be >= 1, got 0"]),
        (["--num-workers", "0"], ["--num-workers: must be >= 1, got 0"]),
        (["--precision", "fp16", "--no-use-gpu"], ["--precision: fp16 needs CUDA", "bf16 or fp32"]),
        (["--precision", "fp8"], ["--precision", "invalid choice: 'fp8'"]),
        (["--weights", "/no/such/model.pt"], ["--weights: no such file /no/such/model.pt"]),
        (["--resume-from", "/no/such/ckpt"], ["--resume-from: /no/such/ckpt holds no model.pt"]),
        (["--warmup-epochs", "-1"], ["--warmup-epochs: must be >= 0"]),
        (["--loader-workers", "-1"], ["--loader-workers: must be >= 0, got -1"]),
        (["--loader-workers", "two"], ["--loader-workers: expected int, got 'two'"]),
        (["--loader-prefetch", "0"], ["--loader-prefetch: must be >= 1, got 0"]),
        # compiled execution (issue 51)
        (["--compile", "--compile-mode", "fast"], ["--compile-mode", "invalid choice: 'fast'", "'reduce-overhead'"]),
        (["--compile-mode", "max-autotune"], ["--compile-mode: needs --compile"]),
        (["--compile-cache", "/tmp/graphs"], ["--compile-cache: needs --compile"]),
        (["--memory-format", "nhwc"], ["--memory-format", "invalid choice: 'nhwc'", "'channels_last', 'contiguous'"]),
        # the recipe (issue 49's options so far)
        (["--label-smoothing", "1"], ["--label-smoothing: must be in [0, 1), got 1.0"]),
        (["--norm-weight-decay", "-0.1"], ["--norm-weight-decay: must be >= 0, got -0.1"]),
        (["--mixup-alpha=-0.2"], ["--mixup-alpha: must be >= 0 (0: off), got -0.2"]),
        (["--cutmix-alpha=-1"], ["--cutmix-alpha: must be >= 0 (0: off), got -1.0"]),
        (["--auto-augment", "rand"], ["--auto-augment", "invalid choice: 'rand'", "'ra', 'ta_wide', 'augmix'"]),
        (["--ra-magnitude", "31"], ["--ra-magnitude: must be in [0, 30], got 31"]),
        (["--augmix-severity", "0"], ["--augmix-severity: must be in [1, 10], got 0"]),
        (["--random-erase", "1.5"], ["--random-erase: must be in [0, 1], got 1.5"]),
        (["--model-ema-steps", "0"], ["--model-ema-steps: must be >= 1, got 0"]),
        (["--model-ema-decay", "1.1"], ["--model-ema-decay: must be in [0, 1], got 1.1"]),
        (["--val-crop-size", "0"], ["--val-crop-size: must be >= 1, got 0"]),
        (["--interpolation", "lanczos"], ["--interpolation", "invalid choice: 'lanczos'", "'bilinear', 'bicubic'"]),
        (
            ["--train-crop-size", "6"],
            ["--train-crop-size: the training view is --augment's random crop", "with --augment"],
        ),
        # the built-in digits are raw 8x8 pixels: the loader cuts no other view of them
        (
            ["--augment", "--train-crop-size", "6"],
            ["--train-crop-size: the data set is raw pixels stored at its training size 8x8", "accepted: 8 for a crop"],
        ),
        (["--val-resize-size", "10"], ["--val-resize-size: the data set is raw pixels", "data prepare --encoded"]),
        # elastic ranges: every size must split the batch, MIN <= MAX, MIN >= 1, and restarts allowed
        (
            ["--num-workers", "2-4", "--global-batch-size", "64", "--max-failures", "1"],
            ["--num-workers: 3 workers (in 2-4) cannot split --global-batch-size 64 = 64 samples", "these do: 2, 4"],
        ),
        (
            ["--num-workers", "1-5", "--global-batch-size", "48", "--grad-accum-steps", "2", "--max-failures", "1"],
            [
                "--num-workers: 5 workers (in 1-5)",
                "48 / --grad-accum-steps 2 = 24",
                "must divide 24",
                "these do: 1, 2, 3, 4)",
            ],
        ),
        (
            ["--num-workers", "4-2", "--max-failures", "1"],
            ["--num-workers: MIN 4 is larger than MAX 2 in 4-2", "1 <= MIN <= MAX"],
        ),
        (["--num-workers", "0-2", "--max-failures", "1"], ["--num-workers: must be >= 1, got 0-2"]),
        (
            ["--num-workers", "two"],
            ["--num-workers: expected a worker count or a range MIN-MAX (e.g. 2 or 2-8), got 'two'"],
        ),
        (
            ["--num-workers", "1-2"],
            ["--max-failures: an elastic run (--num-workers 1-2) restarts its worker group", ">= 1, or -1"],
        ),
        (["--num-workers", "1-2", "--max-failures", "0"], ["--max-failures: an elastic run"]),
        (["--checkpoint-every-steps", "0"], ["--checkpoint-every-steps: must be >= 1, got 0"]),
        (["--resize-interval", "0"], ["--resize-interval: must be > 0 seconds, got 0.0"]),
        (["--resize-timeout", "-1"], ["--resize-timeout: must be > 0 seconds, got -1.0"]),
    ],
)
def test_bad_options(tmp_path, capsys, argv, fragments):
    runs = tmp_path / "runs"
    res = run_cli(capsys, "ddp", "--storage-path", str(runs), *argv)
    assert_usage_error(res, *fragments)
    assert not runs.exists()


def test_an_elastic_run_hands_its_resize_timeout_to_ray_trains_controller():
    """The start timeout reaches the controller only under a name Ray Train passes on from the driver."""
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    from raytrain_mp.ddp.config import DDPConfig
    from raytrain_mp.ddp.trainer import START_TIMEOUT_ENV, controller_env

    assert START_TIMEOUT_ENV in ENV_VARS_TO_PROPAGATE
    assert controller_env(DDPConfig(num_workers="1-2", max_failures=1)) == {START_TIMEOUT_ENV: "10.0"}
    assert controller_env(DDPConfig(num_workers="2-4", max_failures=1, resize_timeout=2.5)) == {
        START_TIMEOUT_ENV: "2.5"
    }
    assert controller_env(DDPConfig(num_workers=2)) == controller_env(DDPConfig(num_workers="3-3")) == {}


def test_storage_path_not_writable(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = run_cli(capsys, "ddp", "--storage-path", str(blocker / "runs"))
    assert_usage_error(res, "--storage-path", "is not writable")


def test_missing_dataset(tmp_path, capsys):
    res = run_cli(capsys, "ddp", "--data", str(tmp_path / "absent"), "--storage-path", str(tmp_path / "runs"))
    assert_usage_error(res, "--data: no such data set folder", "absent")
    assert not (tmp_path / "runs").exists()


def test_yaml_config_and_flags(tmp_path, capsys):
    from raytrain_mp.config import build_config
    from raytrain_mp.ddp.config import DDPConfig

    path = tmp_path / "c.yaml"
    path.write_text("epochs: 3\nbase-lr: 0.2\nsync_bn: false\nmodel: resnet34\n")
    cfg = build_config(DDPConfig, {"config": str(path), "epochs": "4"})
    assert (cfg.epochs, cfg.base_lr, cfg.sync_bn, cfg.model) == (4, 0.2, False, "resnet34")  # flag wins
    path.write_text("epochs: 3\nlearning_rate: 0.2\n")
    res = run_cli(capsys, "ddp", "--config", str(path))
    assert_usage_error(res, "--config: unknown option 'learning_rate'", "accepted:", "base_lr")
    path.write_text("epochs: many\n")
    res = run_cli(capsys, "ddp", "--config", str(path))
    assert_usage_error(res, "--epochs: expected int, got 'many'", str(path))
    res = run_cli(capsys, "ddp", "--config", str(tmp_path / "none.yaml"))
    assert_usage_error(res, "--config: no such file")


def test_saved_config_leaves_out_hidden_options(tmp_path):
    """A checkpoint's config.yaml (``to_yaml``) has every option but ``json`` and the testing hooks,
    and ``--config`` reads it back to the same config, minus the hook."""
    import dataclasses

    import yaml

    from raytrain_mp.config import build_config, to_yaml
    from raytrain_mp.ddp.config import DDPConfig

    hooks = {"inject_fault": f"0:s3:{tmp_path / 'marker'}", "hold_at_step": f"2:{tmp_path / 'go'}"}
    # what a driver hands its workers: where the run's MLflow run is (tracking.open_run)
    internal = {"mlflow_tracking_uri": "http://127.0.0.1:5000", "mlflow_run_id": "a" * 32, "mlflow_parent_run_id": "b"}
    cfg = DDPConfig(storage_path=str(tmp_path), epochs=3, **hooks, **internal, json=True)
    cfg.validate()
    saved = yaml.safe_load(to_yaml(cfg))
    assert saved == {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("json", *hooks, *internal)}
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert build_config(DDPConfig, {"config": str(path)}) == dataclasses.replace(
        cfg, **dict.fromkeys([*hooks, *internal]), json=False
    )


def test_help_lists_defaults():
    proc = subprocess.run([sys.executable, "-m", "raytrain_mp.cli", "ddp", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--global-batch-size GLOBAL_BATCH_SIZE samples per optimizer step over all workers (default: 64)" in text
    assert "--optimizer {sgd,adamw} optimizer (default: sgd)" in text
    assert "--no-sync-bn" in text and "inject" not in text


def test_cluster_too_small(ray_session, tmp_path, capsys):
    # Counted from the session's CPUs and GPUs, whatever machine runs the test; every global batch
    # divides among its workers, so the check under test is the one that refuses.
    runs = tmp_path / "runs"
    cpus, gpus = session_cpus(), session_gpus()
    res = run_cli(
        capsys,
        "ddp",
        "--num-workers",
        str(cpus + 1),
        "--global-batch-size",
        str((cpus + 1) * 12),
        "--storage-path",
        str(runs),
    )
    assert_usage_error(
        res, f"--num-workers {cpus + 1} needs {cpus + 1} CPUs but the Ray cluster has {cpus}", f"at most {cpus}"
    )
    # Each loader process reserves a CPU in its worker's bundle, beside the training process's one.
    loaders = cpus // 2
    res = run_cli(capsys, "ddp", "--num-workers", "2", "--loader-workers", str(loaders), "--storage-path", str(runs))
    assert_usage_error(
        res,
        f"--num-workers 2 needs {2 * (loaders + 1)} CPUs but the Ray cluster has {cpus}",
        f"at most {cpus // (loaders + 1)}",
    )
    # one worker more than the cluster has GPUs; the session's CPUs hold them all (helpers.session_cpus)
    more = str(gpus + 1)
    res = run_cli(
        capsys,
        "ddp",
        "--num-workers",
        more,
        "--global-batch-size",
        str((gpus + 1) * 16),
        "--use-gpu",
        "--storage-path",
        str(runs),
    )
    assert_usage_error(res, f"--num-workers {more} needs {more} GPUs but the Ray cluster has {gpus}", "--no-use-gpu")
    res = run_cli(
        capsys,
        "ddp",
        "--num-workers",
        more,
        "--global-batch-size",
        str((gpus + 1) * 16),
        "--precision",
        "fp16",
        "--storage-path",
        str(runs),
    )
    assert_usage_error(res, "--precision: fp16 needs CUDA")  # too few GPUs for each worker: the default picked CPUs
    assert not runs.exists()


def test_every_recipe_file_is_a_valid_config_and_the_v2_recipe_carries_the_references_values():
    from pathlib import Path

    from raytrain_mp.config import build_config
    from raytrain_mp.ddp.config import DDPConfig

    files = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert [f.name for f in files] == ["resnet50-finetune.yaml", "resnet50-imagenet-v2.yaml"]
    configs = {f.name: build_config(DDPConfig, {"config": str(f)}) for f in files}
    v2 = configs["resnet50-imagenet-v2.yaml"]
    # references/classification: 8 x 128 at lr 0.5, so 0.125 at 256 under the linear rule
    assert (v2.global_batch_size, v2.base_lr * v2.global_batch_size / v2.base_batch) == (1024, 0.5)
    assert (v2.epochs, v2.warmup_epochs, v2.lr_decay, v2.weight_decay, v2.norm_weight_decay) == (
        600,
        5,
        "cosine",
        2e-5,
        0.0,
    )
    assert (v2.auto_augment, v2.random_erase, v2.label_smoothing, v2.mixup_alpha, v2.cutmix_alpha) == (
        "ta_wide",
        0.1,
        0.1,
        0.2,
        1.0,
    )
    assert (v2.model_ema, v2.model_ema_steps, v2.model_ema_decay) == (True, 32, 0.99998)
    assert (v2.ra_sampler, v2.ra_reps, v2.augment) == (True, 4, True)
    assert (v2.train_crop_size, v2.val_resize_size, v2.val_crop_size, v2.interpolation) == (176, 232, 224, "bilinear")
    finetune = configs["resnet50-finetune.yaml"]
    assert (finetune.weights, finetune.backbone_lr_scale) == ("IMAGENET1K_V2", 0.1)
