"""``--model`` through the real command line: every bad model is one line, exit code 2, before Ray
starts and before anything is written, in each command that takes it; ``--help`` says where the
names come from."""

from __future__ import annotations

import subprocess

import pytest

from helpers import assert_usage_error, run_cli

MODULE = """
from torch import nn

def fails(num_classes, in_channels, image_size):
    raise ValueError("no GPU here")

def not_a_module(num_classes, in_channels, image_size):
    return "a string"

NOT_CALLABLE = 3


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        if x.mean() > 0:  # control flow on a value: torch.fx cannot trace it
            x = -x
        return self.fc(x.flatten(1))


def untraceable(num_classes, in_channels, image_size):
    return DataDependent()
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "badmodels.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "badmodels", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "model, fragments",
    [
        ("resnet181", ["--model: unknown model 'resnet181'; closest: resnet18, resnet101", "package.module:callable"]),
        (
            "nosuchmodule:net",
            ["--model: module 'nosuchmodule' does not import (ModuleNotFoundError: No module named 'nosuchmodule')"],
        ),
        ("badmodels:absent", ["--model: module 'badmodels' has no attribute 'absent'"]),
        ("badmodels:NOT_CALLABLE", ["--model: badmodels:NOT_CALLABLE is not callable (an int)"]),
        (
            "badmodels:fails",
            ["--model: badmodels:fails(num_classes=10, in_channels=1, image_size=8) raised ValueError: no GPU here"],
        ),
        ("badmodels:not_a_module", ["returned builtins.str, not a torch.nn.Module"]),
        (
            "alexnet",
            [
                "--model: alexnet cannot take 8x8 images",
                "the smallest size that works",
                "is 64: prepare the data with --image-size 64",
            ],
        ),
        (
            "vit_b_16",
            [
                "--model: vit_b_16 cuts images into 16x16 patches",
                "the data's 8 px is not: prepare the data with --image-size 16",
            ],
        ),
    ],
)
def test_ddp_reports_a_bad_model_before_ray_starts(workdir, digits_dir, capsys, model, fragments):
    runs = workdir / "runs"
    res = run_cli(capsys, "ddp", "--data", digits_dir, "--storage-path", str(runs), "--model", model)
    assert_usage_error(res, *fragments)
    assert not runs.exists()


def test_tune_and_bench_ddp_check_the_model_too(workdir, digits_dir, capsys):
    runs = workdir / "runs"
    res = run_cli(
        capsys,
        "tune",
        "--data",
        digits_dir,
        "--storage-path",
        str(runs),
        "--global-batch-sizes",
        "64",
        "--model",
        "badmodels:fails",
    )
    assert_usage_error(
        res, "--model: badmodels:fails(num_classes=10, in_channels=1, image_size=8) raised ValueError: no GPU here"
    )
    res = run_cli(
        capsys, "bench", "ddp", "--out", str(workdir / "bench"), "--image-size", "16", "--model", "convnext_tiny"
    )
    assert_usage_error(
        res, "--model: convnext_tiny cannot take 16x16 images", "is 32: prepare the data with --image-size 32"
    )
    res = run_cli(capsys, "bench", "pipeline", "--out", str(workdir / "bench"), "--model", "mobilenet_v3_small")
    assert_usage_error(res, "--model", "invalid choice: 'mobilenet_v3_small'", "resnet50")
    assert not runs.exists() and not (workdir / "bench").exists()


def test_pipeline_reports_a_model_it_cannot_cut_and_a_split_point_it_lacks(workdir, digits_dir, capsys):
    runs = workdir / "runs"
    base = ("pipeline", "--data", digits_dir, "--storage-path", str(runs))
    res = run_cli(capsys, *base, "--model", "badmodels:fails")
    assert_usage_error(
        res, "--model: badmodels:fails(num_classes=10, in_channels=1, image_size=8) raised ValueError: no GPU here"
    )
    res = run_cli(capsys, *base, "--model", "badmodels:untraceable")
    assert_usage_error(
        res,
        "--model: the pipeline cannot trace DataDependent.forward with torch.fx (symbolically traced variables "
        "cannot be used as inputs to control flow at ",
        "badmodels.py:19); its own forward must be traceable (move the untraceable part into a submodule, which "
        "then runs whole in one stage), or give an nn.Sequential",
    )
    res = run_cli(capsys, *base, "--model", "mobilenet_v3_small", "--split-points", "features.99")
    assert_usage_error(res, "--split-points: 'features.99' names no block; blocks: features.0.0, features.0.1, ")
    assert not runs.exists()


def test_a_yaml_config_takes_the_same_string(workdir, digits_dir, capsys):
    config = workdir / "run.yaml"
    config.write_text("model: badmodels:absent\n")
    res = run_cli(capsys, "ddp", "--data", digits_dir, "--storage-path", str(workdir / "runs"), "--config", str(config))
    assert_usage_error(res, "--model: module 'badmodels' has no attribute 'absent'")


def test_help_says_where_model_names_come_from():
    text = " ".join(
        subprocess.run(["raytrain-mp", "ddp", "--help"], capture_output=True, text=True, check=True).stdout.split()
    )
    assert (
        "any torchvision.models classifier (torchvision.models.list_models()), e.g. resnet18, mobilenet_v3_small, "
        "vit_b_16; or package.module:callable" in text
    )
