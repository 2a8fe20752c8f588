"""`raytrain-mp tune --storage-path s3://...` against a real S3 protocol server on 127.0.0.1: the
trials' runs, the table, the plot and best.yaml land in the bucket under the reported URIs, and
``--resume`` of the experiment's URI works."""

from __future__ import annotations

import pytest

from raytrain_mp.storage import join, locate

from helpers import run_cli_json

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_sweep_writes_its_outputs_into_the_bucket_and_resumes_from_it(bucket, tmp_path, monkeypatch):
    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import make_synthetic_source

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "tiny"
    write_dataset(make_synthetic_source(200, 8, 4, 1, 0.2, 11), data)
    storage = join(bucket, "sweeps")
    result = run_cli_json(
        "tune", "--no-use-gpu", "--data", str(data), "--global-batch-sizes", "32", "--base-lrs", "0.1",
        "--epochs", "1", "--scheduler", "none", "--num-workers", "1", "--storage-path", storage, "--name", "lr",
        "--log-every", "0",
    )  # fmt: skip
    experiment = locate(storage, "--storage-path").child("lr")
    assert result["experiment"] == experiment.uri and result["trials"] == 1
    for key, name in [
        ("table_csv", "sweep_table.csv"),
        ("table_parquet", "sweep_table.parquet"),
        ("plot", "sweep_lr.png"),
        ("best_yaml", "best.yaml"),
    ]:
        assert result[key] == experiment.child(name).uri and experiment.child(name).is_file(), key
    assert experiment.child("sweep.yaml").is_file()
    assert experiment.child("sweep_lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(experiment.child("sweep_table.csv").read_bytes().decode().strip().splitlines()) == 1 + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # nothing named "s3:" here

    resumed = run_cli_json("tune", "--resume", experiment.uri)
    assert resumed["trials"] == 1 and resumed["best_yaml"] == experiment.child("best.yaml").uri
