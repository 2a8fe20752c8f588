"""``raytrain-mp predict`` on an encoded data set (JPEG and PNG files kept as files): the files of
the validation split, given to predict, get the classes eval predicts for those samples, through
the same Resize + CenterCrop the loader cuts."""

from __future__ import annotations

import csv
import io

import pytest

from helpers import make_image_folder, run_cli_json

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def encoded_run(ray_session, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("after-encoded")
    folder = make_image_folder(root / "images")
    data = str(root / "data")
    assert run_cli_json(
        "data",
        "prepare",
        f"imagefolder:{folder}",
        "--encoded",
        "--image-size",
        "32",
        "--val-fraction",
        "0.4",
        "--out",
        data,
    )["encoded"]
    result = run_cli_json("ddp", "--data", data, "--epochs", "1", "--num-workers", "1", "--global-batch-size", "3",
                          "--no-use-gpu", "--storage-path", str(root / "runs"), "--name", "enc")  # fmt: skip
    return {**result, "data": data}


def test_predict_gives_evals_classes_for_encoded_validation_files(encoded_run, tmp_path):
    from PIL import Image

    from raytrain_mp.data import ParquetImageDataset

    val = ParquetImageDataset(encoded_run["data"], "val")
    folder = tmp_path / "files"
    folder.mkdir()
    for i in range(len(val)):
        data = val.stored(i)
        kind = Image.open(io.BytesIO(data)).format
        (folder / f"{i:03d}.{'jpg' if kind == 'JPEG' else 'png'}").write_bytes(data)
    out = tmp_path / "eval"
    evaluated = run_cli_json(
        "eval", "--checkpoint", encoded_run["run"], "--num-workers", "2", "--no-use-gpu", "--out", str(out)
    )
    assert (evaluated["count"], evaluated["accuracy"]) == (encoded_run["val_count"], encoded_run["val_accuracy"])
    assert abs(evaluated["loss"] - encoded_run["val_loss"]) <= 1e-6
    expected = [r["predicted_name"] for r in csv.DictReader((out / "predictions.csv").open())]
    result = run_cli_json("predict", "--checkpoint", encoded_run["run"], str(folder), "--top-k", "2")
    assert [p["classes"][0] for p in result["predictions"]] == expected
    assert {name for p in result["predictions"] for name in p["classes"]} <= {"class0", "class1", "class2"}
