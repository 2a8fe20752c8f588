"""The uint8 data path: loader processes, device-side transforms, encoded image folders.

The reference for the transforms is the per-sample float path they replaced, kept in
``raytrain_mp.bench.data_peers`` (``bench data`` measures it too).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

from raytrain_mp.bench.data_peers import PerSampleFloatDataset
from raytrain_mp.data import ParquetImageDataset, read_meta
from raytrain_mp.data.augment import SCALE, resized_crop
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.data.prepare import write_dataset
from raytrain_mp.data.sources import make_synthetic_source
from raytrain_mp.data.transforms import crop_flip, gathered, normalization

from helpers import assert_usage_error, make_image_folder, run_cli, run_cli_json

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("syn") / "d"
    write_dataset(make_synthetic_source(60, 12, 3, 3, 0.2, 4), out)
    return str(out)


@pytest.mark.parametrize("epoch", [0, 3])
def test_device_transforms_equal_the_per_sample_path(synthetic, epoch):
    new = ParquetImageDataset(synthetic, "train", augment=True, seed=5)
    indices = list(range(len(new)))
    images, _, params = new.batch((epoch, i) for i in indices)
    assert (
        params[:, 2].sum() not in (0, len(indices)) and len(set(params[:, 0].tolist())) > 1
    )  # crops and flips both vary
    # uint8: the crop and flip alone, exactly the old per-sample code's on the stored pixels.
    old = PerSampleFloatDataset(synthetic, "train", augment=True, seed=5, dtype=torch.float64)
    old.set_epoch(epoch)
    cropped = crop_flip(images, params, new.transform.pad)
    padded = torch.nn.functional.pad(images, (new.transform.pad,) * 4)
    assert torch.equal(gathered(padded, params, 12, 12), cropped)  # the GPU's way, run here on the CPU
    for i in indices:
        expected = old._augmented(new.raw_image(i), i).transpose(2, 0, 1)
        assert torch.equal(cropped[i], torch.from_numpy(np.ascontiguousarray(expected)))
    # After normalization: the same arithmetic, so float64 is bit for bit and float32 within rounding.
    reference = torch.stack([old[i][0] for i in indices])
    assert torch.equal(new.transform(images, params, CPU, torch.float64), reference)
    fp32 = new.transform(images, params, CPU, torch.float32)
    assert fp32.dtype == torch.float32 and (fp32.double() - reference).abs().max().item() <= 1e-6


def test_without_augmentation_the_transform_only_normalizes(synthetic):
    ds = ParquetImageDataset(synthetic, "val")
    images, _, params = ds.batch(range(len(ds)))
    old = PerSampleFloatDataset(synthetic, "val", dtype=torch.float64)
    assert torch.equal(
        ds.transform(images, params, CPU, torch.float64), torch.stack([old[i][0] for i in range(len(ds))])
    )


def test_normalization_constants_are_made_once_per_device_and_dtype(synthetic):
    ds = ParquetImageDataset(synthetic, "val")
    normalization.cache_clear()
    images, _, params = ds.batch(range(len(ds)))
    for _ in range(3):
        ds.transform(images, params, CPU, torch.float32)
    ds.transform(images, params, CPU, torch.float64)
    info = normalization.cache_info()
    assert (info.misses, info.hits) == (2, 2)
    mean, std = normalization(tuple(ds.meta.mean), tuple(ds.meta.std), CPU, torch.float64)
    assert mean.shape == std.shape == (1, len(ds.meta.mean), 1, 1) and mean.flatten().tolist() == list(ds.meta.mean)


def test_loader_processes_give_the_same_batches_every_epoch(synthetic):
    """Two persistent loader processes, a sampler split over 2 ranks: the batches equal the ones
    read in this process, epoch after epoch (the epoch travels with each index)."""
    ds = ParquetImageDataset(synthetic, "train", augment=True, seed=2)

    def epochs(workers: int) -> list[list[torch.Tensor]]:
        sampler = EpochKeys(DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=2))
        loader = make_loader(ds, 8, sampler, workers, prefetch=2)
        seen = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            seen.append([torch.cat([images.flatten(), labels, params.flatten()]) for images, labels, params in loader])
        return seen

    inline, processes = epochs(0), epochs(2)
    assert [len(e) for e in inline] == [3, 3, 3]
    assert all(torch.equal(a, b) for e, f in zip(inline, processes) for a, b in zip(e, f))
    assert not torch.equal(inline[0][0], inline[1][0])


def test_resized_crop_stays_inside_the_recipe():
    for index in range(200):
        height, width = (300, 200) if index % 2 else (50, 400)
        top, left, h, w, flip = resized_crop(1, 0, index, height, width)
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and flip in (0, 1)
        tried = SCALE[0] * height * width * 0.9 <= h * w  # else the center-crop fallback
        assert tried or (h, w) in ((height, round(height * 4 / 3)), (round(width * 3 / 4), width), (height, width))
    assert resized_crop(1, 0, 7, 300, 200) == resized_crop(1, 0, 7, 300, 200) != resized_crop(1, 1, 7, 300, 200)


@pytest.fixture(scope="module")
def encoded(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("enc")
    folder = make_image_folder(base / "images")
    out = base / "prepared"
    assert run_cli_json(
        "data", "prepare", f"imagefolder:{folder}", "--encoded", "--image-size", "32", "--out", str(out)
    )["encoded"]
    return folder, out


def test_encoded_folder_keeps_the_files_and_decodes_to_the_recipe(encoded):
    folder, out = encoded
    meta = read_meta(str(out))
    assert meta.encoded and meta.image_shape == (32, 32, 3) and meta.counts == {"train": 12, "val": 3}
    files = sorted(folder.rglob("*.*"))
    train = ParquetImageDataset(str(out), "train", augment=True, seed=1)
    stored = {train.stored(i) for i in range(len(train))}
    assert stored <= {f.read_bytes() for f in files}  # each file's own bytes, at its own size
    # The mean and std are of every train pixel, as decoded.
    pixels = np.concatenate([np.asarray(Image.open(files[i]).convert("RGB")).reshape(-1, 3) for i in train.ids]).astype(
        np.float64
    )
    assert np.allclose(meta.mean, pixels.mean(axis=0), rtol=1e-9) and np.allclose(
        meta.std, pixels.std(axis=0), rtol=1e-9
    )
    image, _, params = train[(2, 4)]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and params[:2].tolist() == [0, 0]
    assert torch.equal(image, train[(2, 4)][0]) and not torch.equal(image, train[(3, 4)][0])
    val = ParquetImageDataset(str(out), "val")
    images, _, params = val.batch(range(len(val)))
    assert images.shape == (3, 3, 32, 32) and params.abs().sum() == 0
    # A flip drawn in the loader happens on the device: the batch transform mirrors it.
    flips = torch.tensor([[0, 0, 1]] * 3)
    assert torch.equal(crop_flip(images, flips, train.transform.pad), images.flip(3))


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
def test_an_encoded_runs_views_are_the_references_presets(encoded, interpolation):
    """--train-crop-size, --val-resize-size, --val-crop-size and --interpolation cut what
    torchvision's reference presets cut (``ClassificationPresetTrain``'s RandomResizedCrop with the
    drawn box, ``ClassificationPresetEval``'s Resize + CenterCrop), on the decoded image."""
    from torchvision.transforms import v2

    from raytrain_mp.data.encoded import decode
    from raytrain_mp.views import Views

    _, out = encoded
    meta = read_meta(str(out))
    options = {"train_crop_size": 20, "val_resize_size": 36, "val_crop_size": 28, "interpolation": interpolation}
    views = Views.of(meta, options)
    assert views == Views((20, 20), (28, 28), 36, interpolation)
    mode = v2.InterpolationMode(interpolation)
    train = ParquetImageDataset(str(out), "train", augment=True, seed=3, meta=meta, views=views)
    for epoch, index in [(0, 0), (1, 5), (4, 11)]:
        image, _, params = train[(epoch, index)]
        decoded = decode(train.stored(index))
        top, left, h, w, flip = resized_crop(3, epoch, index, *decoded.shape[1:])
        expected = v2.functional.resized_crop(decoded, top, left, h, w, [20, 20], interpolation=mode, antialias=True)
        assert torch.equal(image, expected) and params[2] == flip
    val = ParquetImageDataset(str(out), "val", meta=meta, views=views)
    preset = v2.Compose([v2.Resize(36, interpolation=mode, antialias=True), v2.CenterCrop(28)])
    for index in range(len(val)):
        assert torch.equal(val[index][0], preset(decode(val.stored(index))))


def test_views_default_to_the_data_sets_size_and_refuse_what_a_raw_set_cannot_cut(encoded, synthetic):
    from raytrain_mp.errors import UsageError
    from raytrain_mp.views import Views

    encoded_meta, raw = read_meta(str(encoded[1])), read_meta(synthetic)
    # A run without the options (or saved before them) cuts what runs always cut: 32, and 37 -> 32.
    assert Views.of(encoded_meta) == Views.of(encoded_meta, {"model": "resnet18"}) == Views((32, 32), (32, 32), 37)
    assert Views.of(encoded_meta, {"val_crop_size": 28}).val_resize == 32  # 8/7 of the crop
    assert Views.of(encoded_meta, {"val_crop_size": 28}).training_hw(augment=False) == (28, 28)
    assert Views.of(raw) == Views((12, 12), (12, 12), 0) and Views.of(raw, {"val_crop_size": 12}) == Views.of(raw)
    with pytest.raises(UsageError, match=r"^--val-crop-size: 40 is larger than the validation resize 36"):
        Views.of(encoded_meta, {"val_resize_size": 36, "val_crop_size": 40})
    for name, value in [
        ("train_crop_size", 10),
        ("val_crop_size", 14),
        ("val_resize_size", 14),
        ("interpolation", "bicubic"),
    ]:
        with pytest.raises(UsageError, match=rf"^--{name.replace('_', '-')}: the data set is raw pixels stored at"):
            Views.of(raw, {name: value})


def test_a_pipeline_refuses_training_and_validation_views_of_two_shapes(encoded):
    from raytrain_mp.errors import UsageError
    from raytrain_mp.pipeline.config import PipelineConfig
    from raytrain_mp.pipeline.feed import StageData

    _, out = encoded
    meta = read_meta(str(out))
    same = PipelineConfig(data=str(out), augment=True, train_crop_size=28, val_crop_size=28, global_batch_size=4)
    assert StageData.of_run(same, meta).input_hw(meta) == (28, 28)
    two = PipelineConfig(data=str(out), augment=True, train_crop_size=24, global_batch_size=4)
    with pytest.raises(UsageError, match=r"training views are 24x24 and the validation views 32x32"):
        StageData.of_run(two, meta)


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]), "truncated"),
        (lambda f: f.write_text("not an image"), "not a readable JPEG or PNG"),
    ],
)
def test_a_bad_file_is_named_and_nothing_is_written(tmp_path, capsys, damage, fragment):
    folder = make_image_folder(tmp_path / "images", seed=1)
    bad = folder / "class1" / "3.jpg"
    damage(bad)
    out = tmp_path / "prepared"
    res = run_cli(capsys, "data", "prepare", f"imagefolder:{folder}", "--encoded", "--out", str(out))
    assert_usage_error(res, str(bad), fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images"]


def test_encoded_is_for_image_folders_only(tmp_path, capsys):
    res = run_cli(capsys, "data", "prepare", "synthetic", "--encoded", "--out", str(tmp_path / "x"))
    assert_usage_error(res, "--encoded: applies to imagefolder:PATH only")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs its checks (minutes)")
def test_the_gpu_check_script_skips_cleanly_without_cuda(tmp_path):
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_data.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("gpu_check_data: skipped"), done.stderr[-2000:]
    assert "skipped" in json.loads((tmp_path / "gpu_check_data.json").read_text())
