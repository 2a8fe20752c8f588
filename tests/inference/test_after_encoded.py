"""``raytrain-mp predict`` on an encoded data set (JPEG and PNG files kept as files): the files of
the validation split, given to predict, get the classes eval predicts for those samples, through
the same Resize + CenterCrop the loader cuts. The run trains as ``ddp`` does on such a folder: 2
workers with a loader process each, augmented, 2 epochs, at views of its own (``--train-crop-size``
24, ``--val-resize-size`` 36, ``--val-crop-size`` 28, bicubic, of the 32 px data set), which
``eval``, ``predict`` and ``export``'s sidecar take from its config.yaml."""

from __future__ import annotations

import csv
import io

import pytest

from helpers import make_image_folder, run_cli_json

pytestmark = pytest.mark.slow


VIEWS = ["--train-crop-size", "24", "--val-resize-size", "36", "--val-crop-size", "28", "--interpolation", "bicubic"]


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
    result = run_cli_json(
        "ddp", "--no-use-gpu", "--data", data, "--augment", "--num-workers", "2", "--loader-workers", "1",
        "--epochs", "2", "--global-batch-size", "4", "--storage-path", str(root / "runs"), "--name", "enc",
        "--log-every", "0", *VIEWS,
    )  # fmt: skip
    return {**result, "data": data}


def test_an_encoded_image_folder_trains(encoded_run):
    from raytrain_mp.data import read_meta
    from raytrain_mp.models import build_model

    from helpers import load_model_pt

    assert encoded_run["epochs"] == 2 and encoded_run["world_size"] == 2
    assert encoded_run["val_count"] == read_meta(encoded_run["data"]).counts["val"] > 0
    state = load_model_pt(encoded_run)
    assert state["conv1.weight"].shape == (64, 3, 3, 3)  # small stem: 32 px
    build_model("resnet18", 3, 3, True).load_state_dict(state, strict=True)


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


def test_the_runs_views_reach_its_model_and_exports_sidecar(encoded_run, tmp_path):
    from raytrain_mp.inference.checkpoint import load_run
    from raytrain_mp.inference.export import sidecar

    run, _ = load_run(encoded_run["run"], False)
    assert run.input_shape == (28, 28, 3)
    described = sidecar(
        run.meta, run.transform(), run.views, run.input_shape, "pt2", tmp_path / "m", run.checkpoint, False
    )
    assert described["input"]["shape"] == ["batch", 3, 28, 28]
    assert described["resize"] == {"shorter_side": 36, "interpolation": "bicubic", "antialias": True}
    assert described["crop"] == {"center": [28, 28]}
