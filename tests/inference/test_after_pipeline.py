"""``raytrain-mp eval`` and ``export`` on a pipeline run's merged checkpoint: the model is rebuilt
from the pipeline's own config.yaml, and eval meets the run's last validation exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import assert_ordinary_modes, run_cli_json, tiny_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline_run(ray_session, tmp_path_factory) -> dict:
    return tiny_run(
        tmp_path_factory.mktemp("after-pipeline"), "pipeline", "--stages", "2", "--name", "pipe", train=128, val=60
    )


def test_eval_of_a_pipeline_checkpoint_meets_the_runs_validation(pipeline_run, tmp_path):
    result = run_cli_json("eval", "--checkpoint", pipeline_run["run"], "--num-workers", "2", "--no-use-gpu")
    out = Path(result["eval"]).parent  # without --out: a new folder in the run folder
    assert out.parent == Path(pipeline_run["run"]) / "eval" and out.name.startswith("val-")
    assert result["checkpoint"] == pipeline_run["checkpoint"]
    assert result["count"] == pipeline_run["val_count"] == 60
    assert result["accuracy"] == pipeline_run["val_accuracy"]
    assert abs(result["loss"] - pipeline_run["val_loss"]) <= 1e-6


def test_export_of_a_pipeline_checkpoint(pipeline_run, tmp_path):
    result = run_cli_json(
        "export", "--checkpoint", pipeline_run["run"], "--format", "pt2", "--out", str(tmp_path / "m.pt2")
    )
    assert result["max_abs_difference"] <= 1e-5 and (tmp_path / "m.pt2").is_file()
    assert_ordinary_modes(tmp_path / "m.pt2", pipeline_run["run"])  # the run folder, and its eval/ if it has one
