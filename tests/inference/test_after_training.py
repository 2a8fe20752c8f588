"""``raytrain-mp eval``, ``predict`` and ``export`` on the checkpoint of one real tiny ddp run.

The module shares one ``raytrain-mp ddp --epochs 1`` run on a cut of digits (the fixture ``run``);
every check reads what that run wrote: its ``--json`` summary is the reference eval must meet.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys

import numpy as np
import pytest
import torch

from raytrain_mp.checkpointing import RAY_SNAPSHOT
from raytrain_mp.inference.checkpoint import load_run, resolve_checkpoint

from helpers import assert_ordinary_modes, assert_usage_error, run_cli, run_cli_json, tiny_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory) -> dict:
    return tiny_run(tmp_path_factory.mktemp("after"), "ddp", "--num-workers", "1", "--name", "tiny", train=256, val=100)


def test_a_run_folder_resolves_to_its_newest_complete_checkpoint(run, tmp_path):
    assert resolve_checkpoint(run["run"]).uri == run["checkpoint"]
    assert resolve_checkpoint(run["checkpoint"]).uri == run["checkpoint"]
    copy = tmp_path / "copy"
    shutil.copytree(run["run"], copy)
    # By (epoch, step): step 4 of epoch 1 came before epoch 1's end, step 4 of epoch 2 after it.
    for name in ("checkpoint_000001_step_000004", "checkpoint_000002_step_000004"):
        shutil.copytree(copy / "checkpoint_000001", copy / name)
    torn = copy / "checkpoint_000002"
    shutil.copytree(copy / "checkpoint_000001", torn)
    (torn / "model.pt").unlink()  # a checkpoint torn by a crash: skipped in a run folder
    # Ray Train's record of the run decides: the copies are complete folders it never registered.
    assert resolve_checkpoint(str(copy)).uri == str(copy / "checkpoint_000001")
    (copy / RAY_SNAPSHOT).unlink()  # without the record, every complete local folder counts
    assert resolve_checkpoint(str(copy)).uri == str(copy / "checkpoint_000002_step_000004")
    shutil.rmtree(copy / "checkpoint_000002_step_000004")
    assert resolve_checkpoint(str(copy)).uri == str(copy / "checkpoint_000001")
    trained, model = load_run(str(copy))
    assert (trained.model_name, trained.meta.num_classes, trained.meta.channels) == ("resnet18", 10, 1)
    saved = torch.load(run["model"], weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("damage, fragments", [
    ("empty", ("--checkpoint:", "holds no checkpoint")),
    ("missing", ("--checkpoint: no such folder",)),
    ("torn", ("--checkpoint:", "torn checkpoint", "model.pt")),
    ("garbage", ("--checkpoint:", "model.pt is torn or not a torch state dict")),
    ("only_torn", ("--checkpoint:", "none complete")),
])  # fmt: skip
def test_a_folder_without_a_usable_checkpoint_is_one_line(run, tmp_path, capsys, damage, fragments):
    target = tmp_path / "target"
    if damage == "empty":
        target.mkdir()
    elif damage in ("torn", "garbage"):
        shutil.copytree(run["checkpoint"], target)
        if damage == "torn":
            (target / "model.pt").unlink()
        else:
            (target / "model.pt").write_bytes(b"not a state dict")
    elif damage == "only_torn":
        shutil.copytree(run["checkpoint"], target / "checkpoint_000001")
        (target / "checkpoint_000001" / "config.yaml").unlink()
    out = tmp_path / "model.pt2"
    result = run_cli(capsys, "export", "--checkpoint", str(target), "--format", "pt2", "--out", str(out))
    assert_usage_error(result, *fragments)
    assert not out.exists()


def _exported_outputs(fmt: str, path, batches):
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return [torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]) for x in batches]
    if fmt == "pt2":
        module = torch.export.load(str(path)).module()
        return [module(x) for x in batches]
    module = torch.jit.load(str(path))
    return [module(x) for x in batches]


@pytest.mark.parametrize("fmt, tolerance", [("onnx", 1e-4), ("pt2", 1e-5), ("torchscript", 1e-5)])
def test_export_loads_back_and_agrees_with_the_model_at_batch_1_and_7(run, tmp_path, fmt, tolerance):
    if fmt == "onnx":
        pytest.importorskip("onnxruntime", reason="the export extra is not installed: pip install -e '.[export]'")
        pytest.importorskip("onnxscript", reason="the export extra is not installed: pip install -e '.[export]'")
    out = tmp_path / f"model.{fmt}"
    result = run_cli_json("export", "--checkpoint", run["run"], "--format", fmt, "--out", str(out))
    assert result["out"] == str(out) and result["input"] == ["batch", 1, 8, 8]
    assert 0 <= result["max_abs_difference"] <= tolerance
    assert_ordinary_modes(out)
    _, model = load_run(run["run"])
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, 1, 8, 8, generator=generator) for n in (1, 7)]
    with torch.no_grad():
        for x, y in zip(batches, _exported_outputs(fmt, out, batches)):
            assert y.shape == (len(x), 10)
            assert (y - model(x)).abs().max().item() <= tolerance


def onnx_top1(model: str, sidecar: dict, png) -> str:
    """docs/inference.md's onnxruntime call on an image file, as a user who has only the two files
    writes it: the sidecar says the mode, size, dtype, mean/std and class names."""
    import onnxruntime
    from PIL import Image

    image = Image.open(png).convert(sidecar["input"]["image_mode"])
    _, channels, height, width = sidecar["input"]["shape"]
    image = image.resize((width, height), Image.BILINEAR)  # sidecar["resize"]; a raw data set: no crop
    x = np.asarray(image, dtype=np.uint8).reshape(height, width, channels).transpose(2, 0, 1)[None]
    if sidecar["input"]["dtype"] == "float32":
        mean, std = (np.array(sidecar["normalization"][k], dtype=np.float32)[:, None, None] for k in ("mean", "std"))
        x = (x.astype(np.float32) - mean) / std
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {sidecar["input"]["name"]: x})
    return sidecar["class_names"][int(logits[0].argmax())]


def test_onnx_sidecar_and_with_preprocessing_give_predicts_top1_for_png_files(run, tmp_path):
    pytest.importorskip("onnxruntime", reason="the export extra is not installed: pip install -e '.[export]'")
    pytest.importorskip("onnxscript", reason="the export extra is not installed: pip install -e '.[export]'")
    from PIL import Image

    from raytrain_mp.data import ParquetImageDataset

    val = ParquetImageDataset(run["data"], "val")
    pngs = []
    for i in range(6):
        pngs.append(tmp_path / f"{i}.png")
        Image.fromarray(val.raw_image(i)[:, :, 0], "L").resize((20, 20)).save(pngs[-1])  # resized, as a user's file is
    predictions = run_cli_json("predict", "--checkpoint", run["run"], *map(str, pngs))["predictions"]
    predicted = [p["classes"][0] for p in predictions]
    for extra, dtype in (((), "float32"), (("--with-preprocessing",), "uint8")):
        out = tmp_path / f"model-{dtype}.onnx"
        result = run_cli_json("export", "--checkpoint", run["run"], "--out", str(out), *extra)
        sidecar = json.loads((tmp_path / f"model-{dtype}.onnx.json").read_text())
        assert result["sidecar"] == str(out) + ".json" and result["input_dtype"] == dtype
        assert sidecar["input"] == {
            "name": "images", "shape": ["batch", 1, 8, 8], "layout": "NCHW", "dtype": dtype, "image_mode": "L",
            "value_range": [0, 255] if extra else sidecar["input"]["value_range"],
        }  # fmt: skip
        normalization = sidecar["normalization"]
        assert normalization["in_graph"] == bool(extra) and normalization["pixel_scale"] == [0, 255]
        low, high = sidecar["input"]["value_range"]
        assert low < 0 < high if not extra else (low, high) == (0, 255)
        assert sidecar["resize"] == {"size": [8, 8], "interpolation": "bilinear"} and sidecar["crop"] is None
        assert sidecar["class_names"] == result["class_names"] and sidecar["output"]["shape"] == ["batch", 10]
        assert [onnx_top1(str(out), sidecar, png) for png in pngs] == predicted


def test_export_refuses_an_unknown_format_and_a_missing_extra(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "model.x"
    assert_usage_error(
        run_cli(capsys, "export", "--checkpoint", run["run"], "--format", "tflite", "--out", str(out)),
        "--format",
        "tflite",
    )
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as where the extra is not installed: import fails
    result = run_cli(capsys, "export", "--checkpoint", run["run"], "--format", "onnx", "--out", str(out))
    assert_usage_error(result, "onnxruntime", "pip install -e '.[export]'")
    assert not out.exists()


@pytest.fixture(scope="module")
def evaluated(run, tmp_path_factory):
    """``evaluated(W)``: ``raytrain-mp eval`` of the run on W workers, once per W in the module
    (a fit each): its result and output folder."""
    done: dict[int, tuple[dict, object]] = {}

    def evaluate(workers: int) -> tuple[dict, object]:
        if workers not in done:
            out = tmp_path_factory.mktemp(f"eval{workers}")
            done[workers] = (
                run_cli_json(
                    "eval", "--checkpoint", run["run"], "--num-workers", str(workers), "--no-use-gpu", "--out", str(out)
                ),
                out,
            )
        return done[workers]

    return evaluate


@pytest.mark.parametrize("workers", [1, 2])
def test_eval_reports_exactly_the_runs_own_validation(run, evaluated, workers):
    result, out = evaluated(workers)
    assert result["count"] == run["val_count"] == 100
    assert result["accuracy"] == run["val_accuracy"]
    assert abs(result["loss"] - run["val_loss"]) <= 1e-6
    assert result["accuracy"] <= result["top5_accuracy"] <= 1 and result["world_size"] == workers
    saved = json.loads((out / "eval.json").read_text())
    confusion = np.asarray(saved["confusion"])
    assert confusion.sum() == 100 and np.trace(confusion) == round(run["val_accuracy"] * 100)
    rows = list(csv.DictReader((out / "predictions.csv").open()))
    assert len(rows) == 100 and sum(r["label"] == r["predicted"] for r in rows) == np.trace(confusion)
    for name, accuracy in saved["per_class_accuracy"].items():
        i = saved["class_names"].index(name)
        assert accuracy == confusion[i, i] / confusion[i].sum()
    assert (out / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # What eval wrote into --out (pytest made the folder 0700), the run folder and the data set: readable by others.
    assert_ordinary_modes(*out.iterdir(), run["run"], run["data"])


def test_predict_gives_evals_classes_for_the_validation_images(run, evaluated, tmp_path):
    from PIL import Image

    from raytrain_mp.data import ParquetImageDataset

    val = ParquetImageDataset(run["data"], "val")
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(12):
        Image.fromarray(val.raw_image(i)[:, :, 0], "L").save(folder / f"{i:03d}.png")
    _, out = evaluated(1)
    expected = [r["predicted_name"] for r in csv.DictReader((out / "predictions.csv").open())][:12]
    result = run_cli_json(
        "predict", "--checkpoint", run["run"], str(folder), "--top-k", "3", "--csv", str(tmp_path / "p.csv")
    )
    assert [p["classes"][0] for p in result["predictions"]] == expected
    assert all(
        len(p["classes"]) == 3 and p["probabilities"] == sorted(p["probabilities"], reverse=True)
        for p in result["predictions"]
    )
    assert len(list(csv.DictReader((tmp_path / "p.csv").open()))) == 12
    assert_ordinary_modes(tmp_path / "p.csv")


def test_bad_inputs_are_one_line_and_write_nothing(run, tmp_path, capsys):
    other = tmp_path / "synthetic"
    assert (
        run_cli(
            capsys, "data", "prepare", "synthetic", "--out", str(other), "--num-samples", "40", "--num-classes", "3"
        ).code
        == 0
    )
    out = tmp_path / "eval"
    result = run_cli(capsys, "eval", "--checkpoint", run["run"], "--data", str(other), "--out", str(out))
    assert_usage_error(result, "--data:", "3 classes", "takes 1x8x8 images of 10 classes")
    assert_usage_error(
        run_cli(capsys, "eval", "--checkpoint", run["run"], "--split", "test", "--out", str(out)), "--split", "test"
    )
    assert not out.exists()
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    result = run_cli(capsys, "predict", "--checkpoint", run["run"], str(not_image), "--csv", str(tmp_path / "p.csv"))
    assert_usage_error(result, "FILE_OR_FOLDER:", str(not_image), "not an image")
    assert not (tmp_path / "p.csv").exists()
    assert_usage_error(
        run_cli(capsys, "predict", "--checkpoint", run["run"], str(tmp_path / "nowhere")), "no such file or folder"
    )


def test_a_run_in_an_object_store_resolves_to_a_checkpoint_ray_registered(run, bucket, tmp_path):
    """The run folder uploaded to a real S3 protocol server (moto): its Ray-registered checkpoint is
    found by URI, a later one that Ray never registered (an upload cut off) is skipped, and the
    model loads from the store."""
    import pyarrow.fs as pafs

    from raytrain_mp.storage import join, locate

    uri = join(bucket, "runs", "tiny")
    target = locate(uri, "--checkpoint")
    pafs.copy_files(run["run"], target.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=target.fs)
    cut_off = target.child("checkpoint_000002")
    pafs.copy_files(
        run["checkpoint"], cut_off.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=target.fs
    )
    assert resolve_checkpoint(uri).uri == join(uri, "checkpoint_000001")
    out = tmp_path / "m.pt2"
    result = run_cli_json("export", "--checkpoint", uri, "--format", "pt2", "--out", str(out))
    assert result["checkpoint"] == join(uri, "checkpoint_000001") and result["max_abs_difference"] <= 1e-5


def test_many_files_are_predicted_on_ray_tasks_as_in_process(run, tmp_path, monkeypatch):
    from PIL import Image

    from raytrain_mp.data import ParquetImageDataset
    from raytrain_mp.inference import predict
    from raytrain_mp.inference.config import PredictConfig

    val = ParquetImageDataset(run["data"], "val")
    for i in range(12):
        Image.fromarray(val.raw_image(i)[:, :, 0], "L").save(tmp_path / f"{i:03d}.png")
    cfg, inputs = predict.with_checked_inputs(PredictConfig(checkpoint=run["run"], files=(str(tmp_path),)))
    monkeypatch.setattr(predict, "CHUNK", 5)  # three tasks of 5, 5 and 2 images
    on_ray = predict._ray_probabilities(cfg, inputs)
    here = predict.probabilities(inputs.run, inputs.images)
    assert on_ray.shape == (12, 10) and (on_ray - here).abs().max().item() <= 1e-6
    assert torch.equal(on_ray.argmax(dim=1), here.argmax(dim=1))
