"""The options of ``eval``, ``predict`` and ``export`` checked before any checkpoint is read: one
line, exit 2, nothing written; and a file that exists may be replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_mp.config import build_config
from raytrain_mp.inference.config import ExportConfig, PredictConfig

from helpers import assert_usage_error, run_cli


@pytest.mark.parametrize("argv, fragments", [
    (["export", "--format", "onnx", "--out", "m.onnx"], ["--checkpoint: required"]),
    (["export", "--checkpoint", "run"], ["--out: required"]),
    (["export", "--checkpoint", "run", "--out", "s3://bucket/m.onnx"], ["--out:", "is a URI; accepted: a local file"]),
    (["export", "--checkpoint", "run", "--format", "keras", "--out", "m"], ["--format", "invalid choice: 'keras'"]),
    (["export", "--checkpoint", "run", "--out", "."], ["--out: . is a folder"]),
    (["predict", "--checkpoint", "run", "x.png", "--top-k", "0"], ["--top-k: must be >= 1, got 0"]),
    (["predict", "--checkpoint", "run", "x.png", "--csv", "gs://b/p.csv"], ["--csv:", "is a URI"]),
    (["predict", "--checkpoint", "run"], ["FILE_OR_FOLDER"]),
    (["eval", "--checkpoint", "run", "--num-workers", "0"], ["--num-workers: must be >= 1, got 0"]),
    (["eval", "--checkpoint", "run", "--split", "test"], ["--split", "invalid choice: 'test'"]),
    (["eval", "--checkpoint", "run", "--out", "s3://b/e"], ["--out:", "is a URI; accepted: a local folder"]),
])  # fmt: skip
def test_bad_options_are_one_line(tmp_path, capsys, monkeypatch, argv, fragments):
    monkeypatch.chdir(tmp_path)
    assert_usage_error(run_cli(capsys, *argv), *fragments)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_file_may_be_replaced(tmp_path):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"old")
    assert build_config(ExportConfig, {"checkpoint": "run", "out": str(out)}).out == str(out)
    assert build_config(PredictConfig, {"checkpoint": "run", "files": ["a.png"], "csv": str(out)}).csv == str(out)


def test_evals_default_folder_is_new_and_in_the_run_folder(tmp_path, monkeypatch):
    from raytrain_mp.inference import report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(report.time, "strftime", lambda fmt: "20261206-071500")
    run = tmp_path / "runs" / "tiny"
    checkpoint = run / "checkpoint_000002"
    checkpoint.mkdir(parents=True)
    first = report.default_out(str(checkpoint), "val", in_run=True)
    assert first == str(run / "eval" / "val-20261206-071500")
    Path(first).mkdir(parents=True)  # the first eval wrote there: the next one, within the second, goes beside it
    assert report.default_out(str(checkpoint), "val", in_run=True) == f"{first}-2"
    store = report.default_out("s3://bucket/runs/tiny/checkpoint_000002?endpoint_override=h:1", "train", in_run=True)
    assert store == str(tmp_path / "eval" / "tiny" / "train-20261206-071500")  # an object store: here
    copied = report.default_out(str(checkpoint), "val", in_run=False)  # a checkpoint folder in no run folder
    assert copied == str(tmp_path / "eval" / "checkpoint_000002" / "val-20261206-071500")
