"""BatchNorm running statistics that cannot have converged: the pure check (``bn_momentum``), the
``--bn-momentum`` option, and one short ddp run of mobilenet_v3_small (momentum 0.01) that ends with
the ``note:`` line, which the same check on its config with ``--bn-momentum 0.1`` does not give."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_mp.bn_momentum import convergence_note, momentum_needed, set_bn_momentum, stale_statistics, steps_needed
from raytrain_mp.epochs import running_stats_note
from raytrain_mp.models import build_model

from helpers import assert_usage_error, run_cli


def meta_model(name: str) -> nn.Module:
    with torch.device("meta"):
        return build_model(name, 10, 3, None, image_size=32)


def test_mobilenet_after_18_steps_gets_the_note_and_bn_momentum_0_1_removes_it():
    model = meta_model("mobilenet_v3_small")
    assert convergence_note(model, 18) == (
        "note: 34 BatchNorm layers with momentum 0.01 still hold 83% of their initial running statistics after 18 "
        "steps, so evaluation, which uses them, is not yet meaningful: train for about 299 steps, or set "
        "--bn-momentum 0.16"
    )
    assert convergence_note(model, 299) is None  # 0.99 ** 299 < 0.05
    assert set_bn_momentum(model, 0.1) == 34
    assert convergence_note(model, 18) is None  # 0.9 ** 18 = 0.15


def test_the_check_is_a_function_of_the_momenta_and_the_steps():
    resnet = meta_model("resnet18")
    assert convergence_note(resnet, 22) is None
    assert stale_statistics(resnet, 5).layers == 20 and stale_statistics(resnet, 5).momentum == 0.1
    mixed = nn.Sequential(nn.BatchNorm2d(2, momentum=0.01), nn.BatchNorm2d(2), nn.BatchNorm2d(2, momentum=None))
    stale = stale_statistics(mixed, 20)  # 0.99 ** 20 = 0.82 is stale; 0.9 ** 20 = 0.12 is not; None never is
    assert (stale.layers, stale.momentum, round(stale.weight, 2)) == (1, 0.01, 0.82)
    assert stale_statistics(nn.Sequential(nn.BatchNorm2d(2, track_running_stats=False)), 1) is None
    assert steps_needed(0.1) == 29 and steps_needed(0.0) is None and momentum_needed(18) == 0.16
    assert "set --bn-momentum" in convergence_note(nn.BatchNorm1d(2, momentum=0.0), 100)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan"])
def test_bad_bn_momentum_is_one_line_before_ray(capsys, tmp_path, value):
    runs = tmp_path / "runs"
    res = run_cli(capsys, "ddp", "--bn-momentum", value, "--storage-path", str(runs))
    assert_usage_error(res, f"--bn-momentum: must be in (0, 1], got {float(value)}")
    assert not runs.exists()


@pytest.mark.slow  # one short ddp run (22 steps of 8x8 digits)
def test_a_short_mobilenet_run_ends_with_the_note(ray_session, digits_dir, tmp_path, capsys):
    from raytrain_mp.inference.checkpoint import load_run

    res = run_cli(capsys, "ddp", "--no-use-gpu", "--model", "mobilenet_v3_small", "--data", digits_dir,
                  "--num-workers", "1", "--epochs", "1", "--global-batch-size", "64", "--log-every", "0",
                  "--storage-path", str(tmp_path), "--name", "m", "--quiet")  # fmt: skip
    assert res.code == 0, res.err[-3000:]
    notes = [line for line in res.err.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: 34 BatchNorm layers with momentum 0.01 still hold 80% of their initial running statistics after 22 "
        "steps, so evaluation, which uses them, is not yet meaningful: train for about 299 steps, or set "
        "--bn-momentum 0.13"
    ]
    run, _ = load_run(str(tmp_path / "m"))  # what eval reads: the run's config.yaml and its newest checkpoint
    assert run.options["bn_momentum"] is None and run.steps_trained == 22
    assert running_stats_note(run.options, run.meta, run.steps_trained) == notes[0]  # eval's note
    assert running_stats_note({**run.options, "bn_momentum": 0.1}, run.meta, 22) is None  # --bn-momentum 0.1
