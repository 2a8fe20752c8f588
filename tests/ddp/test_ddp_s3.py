"""`raytrain-mp ddp` with data and checkpoints in a bucket of a real S3 protocol server on
127.0.0.1: prepare → train → a worker crashes → resume, all in the bucket; the JSON reports full
URIs that hold what it says; a rerun of the finished run reads its summary from the bucket."""

from __future__ import annotations

import pytest
import torch

from raytrain_mp.checkpointing import load_checkpoint
from raytrain_mp.models import build_model
from raytrain_mp.storage import join, locate

from helpers import run_cli, run_cli_json
from run_log_check import checked_run_log

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_ddp_trains_crashes_and_resumes_in_a_bucket(bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = join(bucket, "data", "digits")
    assert run_cli(capsys, "data", "prepare", "digits", "--out", data).code == 0
    storage = join(bucket, "runs")
    marker = tmp_path / "crashed"
    args = ["ddp", "--no-use-gpu", "--data", data, "--storage-path", storage, "--name", "d1", "--num-workers", "2",
            "--global-batch-size", "256", "--epochs", "2", "--log-every", "0"]  # fmt: skip
    result = run_cli_json(*args, "--max-failures", "1", "--inject-fault", f"1:1:{marker}")
    assert marker.read_text() == "rank 1 crashed after epoch 1\n"
    run = locate(storage, "--storage-path").child("d1")
    assert result["run"] == run.uri and result["epochs"] == 2 and result["val_count"] == 359
    assert result["checkpoint"] == run.child("checkpoint_000002").uri
    assert result["model"] == join(storage, "d1", "checkpoint_000002", "model.pt")
    model_state, train_state = load_checkpoint(locate(result["checkpoint"], "--resume-from"))
    build_model("resnet18", 10, in_channels=1, small_stem=True).load_state_dict(model_state, strict=True)
    assert train_state["epoch"] == 1 and isinstance(model_state["fc.weight"], torch.Tensor)
    assert run.child("result.json").is_file()
    checked_run_log(
        run.uri, steps=10, epochs=2, steps_per_epoch=5, log_every=0
    )  # metrics.csv, events, curves in the bucket
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crashed"]  # nothing named "s3:" here

    rerun = run_cli_json(*args)  # finished: the summary comes from the bucket
    assert rerun == result
