"""``raytrain-mp data prepare --out s3://...`` against a real S3 protocol server on 127.0.0.1:
the data set lands in the bucket, reads back sample for sample as the local one, and is never
half there; nothing is written to a local folder named after the URI."""

from __future__ import annotations

import numpy as np
import pyarrow.fs as pafs

from raytrain_mp.data import ParquetImageDataset, read_meta
from raytrain_mp.storage import join, locate

from helpers import assert_usage_error, run_cli


def test_prepare_into_a_bucket_reads_back_as_the_local_data_set(bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = join(bucket, "datasets", "digits")
    res = run_cli(capsys, "data", "prepare", "digits", "--out", uri, "--rows-per-shard", "500", "--json")
    assert res.code == 0, res.err
    assert res.last_json["out"] == uri and res.last_json["train"] + res.last_json["val"] == 1797
    res = run_cli(capsys, "data", "prepare", "digits", "--out", str(tmp_path / "local"), "--rows-per-shard", "500")
    assert res.code == 0, res.err

    where = locate(uri, "--out")
    files = sorted(
        i.path[len(where.path) + 1 :]
        for i in where.fs.get_file_info(pafs.FileSelector(where.path, recursive=True))
        if i.type == pafs.FileType.File
    )
    assert files == [
        "metadata.json",
        "train/part-00000.parquet",
        "train/part-00001.parquet",
        "train/part-00002.parquet",
        "val/part-00000.parquet",
    ]
    assert read_meta(uri) == read_meta(str(tmp_path / "local"))
    remote, local = ParquetImageDataset(uri, "train"), ParquetImageDataset(str(tmp_path / "local"), "train")
    assert len(remote) == len(local) == 1438
    for i in (0, 700, 1437):
        assert np.array_equal(remote.raw_image(i), local.raw_image(i)) and remote[i][1] == local[i][1]
    assert [p.name for p in tmp_path.iterdir()] == ["local"]  # no folder named "s3:"

    res = run_cli(capsys, "data", "prepare", "digits", "--out", uri)
    assert_usage_error(res, f"--out: {uri} already exists and is not empty; choose a new folder or pass --overwrite")
    res = run_cli(capsys, "data", "prepare", "synthetic", "--out", uri, "--overwrite", "--num-samples", "40", "--json")
    assert res.code == 0, res.err
    assert read_meta(uri).counts == {"train": 32, "val": 8}


def test_bad_data_locations_are_one_line(s3_endpoint, capsys, tmp_path):
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    res = run_cli(capsys, "data", "prepare", "digits", "--out", f"s3://no-such-bucket/d{query}")
    assert_usage_error(res, f"--out: s3://no-such-bucket/d{query}: no bucket 'no-such-bucket'; create it first")
    res = run_cli(capsys, "data", "prepare", "digits", "--out", "gopher://host/d")
    assert_usage_error(res, "--out: cannot use gopher://host/d (unknown scheme 'gopher'); accepted: a local folder")
    res = run_cli(capsys, "ddp", "--weights", f"s3://b/model.pt{query}", "--storage-path", str(tmp_path))
    assert_usage_error(res, "--weights: s3://b/model.pt", "is a URI; accepted: a state dict file (a model.pt)")
    res = run_cli(capsys, "bench", "ddp", "--out", f"s3://b/bench{query}")
    assert_usage_error(res, "--out: s3://b/bench", "is a URI; accepted: a local folder")
