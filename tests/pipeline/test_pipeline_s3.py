"""`raytrain-mp pipeline` with its data and checkpoints in a bucket of a real S3 protocol server on
127.0.0.1: checkpoints land in the bucket (none in a local folder named after the URI), every path
it reports is the full URI, a killed stage restarts from the bucket, a torn checkpoint is never
resumed from, and a rerun continues from the bucket."""

from __future__ import annotations

import pytest
import torch

from raytrain_mp.checkpointing import load_checkpoint
from raytrain_mp.models import build_model
from raytrain_mp.storage import join, latest_complete, locate

from helpers import run_cli_json
from run_log_check import checked_run_log

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_pipeline_checkpoints_and_resumes_in_a_bucket(bucket, tmp_path, monkeypatch):
    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import make_synthetic_source

    monkeypatch.chdir(tmp_path)
    data = join(bucket, "data", "tiny")
    write_dataset(make_synthetic_source(200, 8, 4, 1, 0.2, 11), data)
    storage = join(bucket, "runs")
    marker = tmp_path / "killed"
    args = ["pipeline", "--no-use-gpu", "--data", data, "--stages", "2", "--global-batch-size", "32",
            "--microbatches", "2", "--storage-path", storage, "--name", "p1", "--log-every", "0"]  # fmt: skip
    first = run_cli_json(*args, "--epochs", "2", "--max-failures", "1", "--inject-fault", f"1:1:{marker}")
    assert marker.read_text() == "killed stage 1 after epoch 1\n"  # restarted from the bucket's checkpoint
    run = locate(storage, "--storage-path").child("p1")
    assert first["run"] == run.uri and first["checkpoint"] == run.child("checkpoint_000002").uri
    assert first["model"] == join(storage, "p1", "checkpoint_000002", "model.pt")
    assert [f.uri for f in run.folders("checkpoint_")] == [run.child(f"checkpoint_00000{i}").uri for i in (1, 2)]
    assert run.child("result.json").is_file()
    model_state, train_state = load_checkpoint(latest_complete(run, "checkpoint_"))
    build_model("resnet18", 4, in_channels=1, small_stem=True).load_state_dict(model_state, strict=True)
    assert train_state["epoch"] == 1

    # An upload of epoch 3 killed half-way: files, no completion marker. The rerun ignores it.
    torn = run.child("checkpoint_000003")
    torn.child("model.pt").write_bytes(b"half an upload")
    resumed = run_cli_json(*args, "--epochs", "3")
    assert resumed["epochs"] == 3 and resumed["checkpoint"] == run.child("checkpoint_000003").uri
    state, train_state = load_checkpoint(run.child("checkpoint_000003"))
    assert train_state["epoch"] == 2 and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert [f.uri for f in run.folders("checkpoint_")] == [run.child(f"checkpoint_00000{i}").uri for i in (2, 3)]
    checked_run_log(
        run.uri, steps=15, epochs=3, steps_per_epoch=5, log_every=0
    )  # metrics.csv, events, curves in the bucket
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed"]  # nothing named "s3:" here
