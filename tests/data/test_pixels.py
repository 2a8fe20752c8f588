"""Every image mode PIL opens becomes uint8 of the data set's channels, the same way everywhere.

The conversion (``data.pixels``) by mode, with exact pixel values; ``data.encoded``'s train-time
``decode`` and prepare-time ``check_file`` give the conversion's pixels for a folder of every mode;
``data prepare`` of that folder (encoded and raw) gives data sets whose samples all decode and
collate as uint8, with the mean/std of those very pixels; and one epoch of ``raytrain-mp ddp`` on it
(slow: Ray Train's start-up).
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from raytrain_mp.data import ParquetImageDataset, read_meta
from raytrain_mp.data.augment import PARAMS
from raytrain_mp.data.encoded import check_file, decode
from raytrain_mp.data.pixels import to_uint8, to_uint8_image

from helpers import MIXED_MODES, mixed_mode_image_folder, png16_bytes, run_cli, run_cli_json

GRAY16 = [0, 257 * 100, 65535, 255, 256, 256 * 100 + 255]  # 16-bit samples
GRAY16_8 = [0, 100, 255, 0, 1, 100]  # >> 8: the full range scaled, not clipped at 255


def reopened(image: Image.Image, **save) -> Image.Image:
    """``image`` saved as a PNG and opened again, as a file would be."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **save)
    return Image.open(io.BytesIO(buffer.getvalue()))


def row(values, dtype) -> np.ndarray:
    return np.asarray([values], dtype=dtype)


def gray16_png() -> Image.Image:
    image = reopened(Image.fromarray(row(GRAY16, np.uint16)))
    assert image.mode == "I;16"  # what PIL opens a 16-bit grayscale PNG as
    return image


def png16(samples) -> Image.Image:
    """A 16-bit RGB(A) PNG as PIL opens it (its own decoder keeps the high bytes)."""
    return Image.open(io.BytesIO(png16_bytes(np.asarray(samples))))


def palette_png() -> Image.Image:
    image = Image.new("P", (3, 1))
    image.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0])
    image.putdata([0, 1, 2])
    opened = reopened(image, transparency=bytes([255, 0, 128]))  # a tRNS chunk of alphas, one per entry
    assert opened.mode == "P" and isinstance(opened.info["transparency"], bytes)
    return opened


def cmyk() -> Image.Image:
    image = Image.new("CMYK", (4, 1))
    image.putdata([(255, 0, 0, 0), (0, 0, 0, 255), (0, 0, 0, 0), (100, 0, 255, 51)])
    return image


def bilevel_png() -> Image.Image:
    image = Image.new("1", (2, 1))
    image.putdata([0, 1])
    opened = reopened(image)
    assert opened.mode == "1"
    return opened


# (case, image maker, channels, expected (H, W, C) as nested lists: one row)
CASES = [
    ("I;16 PNG", gray16_png, 1, [[[v] for v in GRAY16_8]]),
    ("I;16 PNG to RGB", gray16_png, 3, [[[v] * 3 for v in GRAY16_8]]),
    ("I;16B", lambda: Image.frombytes("I;16B", (6, 1), row(GRAY16, ">u2").tobytes()), 3, [[[v] * 3 for v in GRAY16_8]]),
    ("I;16L", lambda: Image.frombytes("I;16L", (6, 1), row(GRAY16, "<u2").tobytes()), 1, [[[v] for v in GRAY16_8]]),
    (
        "I 32-bit",
        lambda: Image.fromarray(row([-5, 0, 257 * 100, 65535, 70000], np.int32)),
        3,
        [[[0] * 3, [0] * 3, [100] * 3, [255] * 3, [255] * 3]],
    ),
    (
        "F",
        lambda: Image.fromarray(row([-3, 0.4, 1.5, 254.6, 300, np.nan], np.float32)),
        1,
        [[[0], [0], [1], [254], [255], [0]]],
    ),
    (
        "16-bit RGB PNG",
        lambda: png16([[[0, 256 * 100 + 200, 65535], [256, 511, 65280]]]),
        3,
        [[[0, 100, 255], [1, 1, 255]]],
    ),
    (
        "16-bit RGBA PNG",
        lambda: png16([[[0, 25700, 65535, 0], [256, 511, 65280, 32896]]]),
        3,
        [[[0, 100, 255], [1, 1, 255]]],
    ),  # alpha dropped, not composited
    (
        "16-bit RGBA PNG to RGBA",
        lambda: png16([[[0, 25700, 65535, 0], [256, 511, 65280, 32896]]]),
        4,
        [[[0, 100, 255, 0], [1, 1, 255, 128]]],
    ),
    ("16-bit LA PNG", lambda: png16([[[256 * 100 + 200, 65535], [65535, 255]]]), 3, [[[100] * 3, [255] * 3]]),
    ("LA", lambda: reopened(Image.fromarray(row([[10, 20], [200, 0]], np.uint8))), 3, [[[10] * 3, [200] * 3]]),
    (
        "LA to RGBA",
        lambda: reopened(Image.fromarray(row([[10, 20], [200, 0]], np.uint8))),
        4,
        [[[10, 10, 10, 20], [200, 200, 200, 0]]],
    ),
    ("P with transparency", palette_png, 3, [[[0, 0, 0], [255, 0, 0], [0, 255, 0]]]),
    ("P to RGBA", palette_png, 4, [[[0, 0, 0, 255], [255, 0, 0, 0], [0, 255, 0, 128]]]),
    ("P to L", palette_png, 1, [[[0], [76], [150]]]),  # ITU-R 601-2 luma
    ("CMYK", cmyk, 3, [[[0, 255, 255], [0, 0, 0], [255, 255, 255], [124, 204, 0]]]),
    ("1-bit PNG", bilevel_png, 3, [[[0] * 3, [255] * 3]]),
    ("L to RGB", lambda: Image.fromarray(row([7, 250], np.uint8)), 3, [[[7] * 3, [250] * 3]]),
    (
        "RGB to L",
        lambda: Image.fromarray(row([[255, 0, 0], [0, 0, 255], [10, 20, 30]], np.uint8)),
        1,
        [[[76], [29], [18]]],
    ),
    ("RGB to RGBA", lambda: Image.fromarray(row([[1, 2, 3]], np.uint8)), 4, [[[1, 2, 3, 255]]]),
]


@pytest.mark.parametrize("make, channels, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_mode_converts_by_the_documented_rule(make, channels, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. PIL's warning on a palette's transparency dropped via RGB
        pixels = to_uint8(make(), channels)
    assert pixels.dtype == np.uint8 and pixels.flags.writeable
    assert pixels.tolist() == expected


def test_a_mode_or_channel_count_without_a_conversion_is_a_value_error():
    with pytest.raises(ValueError, match="2-channel images"):
        to_uint8(Image.new("RGB", (1, 1)), 2)
    with pytest.raises(ValueError, match="image mode La has no conversion"):
        to_uint8_image(Image.new("La", (1, 1)), 3)


def test_decode_gives_the_conversions_pixels_for_every_mode(tmp_path):
    """Train-time ``decode`` (decode_image for plain 8-bit files, PIL for the rest) and prepare-time
    ``check_file`` agree with ``data.pixels`` on every file, bit for bit."""
    files = sorted(mixed_mode_image_folder(tmp_path / "images").rglob("*.*"))
    assert len(files) == 2 * len(MIXED_MODES)
    for file in files:
        with Image.open(file) as image:
            expected = to_uint8(image, 3)
        decoded = decode(file.read_bytes())
        assert decoded.dtype == torch.uint8 and decoded.shape == (3, *expected.shape[:2]), file
        assert np.array_equal(decoded.permute(1, 2, 0).numpy(), expected), file
        assert np.array_equal(check_file(file), expected), file
    for channels in (1, 2, 3, 4):  # 16-bit gray, gray+alpha, RGB, RGBA: decode_image would give uint16
        samples = np.arange(6 * channels).reshape(2, 3, channels) * 2000
        data = png16_bytes(samples[..., 0] if channels == 1 else samples)
        decoded = decode(data)
        assert decoded.dtype == torch.uint8
        assert np.array_equal(decoded.permute(1, 2, 0).numpy(), to_uint8(Image.open(io.BytesIO(data)), 3))
    with Image.open(tmp_path / "images" / "class0" / "gray16.png") as image:
        samples = np.asarray(image)
    assert samples.max() > 255  # the file is 16-bit, and decodes to its samples >> 8
    assert np.array_equal(decode((tmp_path / "images" / "class0" / "gray16.png").read_bytes())[0].numpy(), samples >> 8)


def sample_files(folder, ds: ParquetImageDataset) -> list:
    files = sorted(folder.rglob("*.*"))  # ImageFolder's order: the source ids
    return [files[i] for i in ds.ids]


def test_prepare_of_a_mixed_mode_folder_decodes_and_collates(tmp_path, capsys):
    folder = mixed_mode_image_folder(tmp_path / "images")
    out = tmp_path / "prepared"
    res = run_cli(
        capsys, "data", "prepare", f"imagefolder:{folder}", "--out", str(out), "--encoded", "--image-size", "16"
    )
    assert res.code == 0, res.err
    meta = read_meta(str(out))
    assert meta.encoded and meta.image_shape == (16, 16, 3) and meta.counts == {"train": 14, "val": 4}
    for split in ("train", "val"):
        for augment in (False, True):
            ds = ParquetImageDataset(str(out), split, augment=augment, seed=1)
            for i in range(len(ds)):
                image, _, _ = ds[i]
                assert image.dtype == torch.uint8 and image.shape == (3, 16, 16)
            images, labels, params = ds.batch(range(len(ds)))
            assert images.dtype == torch.uint8 and images.shape == (len(ds), 3, 16, 16)
            assert labels.shape == (len(ds),) and params.shape == (len(ds), PARAMS)
    # The mean/std are of the converted pixels of every train file: 16-bit ones >> 8, not clipped.
    train = ParquetImageDataset(str(out), "train")
    pixels = np.concatenate([to_uint8(Image.open(f), 3).reshape(-1, 3) for f in sample_files(folder, train)]).astype(
        np.float64
    )
    assert np.allclose(meta.mean, pixels.mean(axis=0), rtol=1e-9) and np.allclose(
        meta.std, pixels.std(axis=0), rtol=1e-9
    )


def test_a_raw_image_folder_converts_modes_the_same_way(tmp_path, capsys):
    folder = mixed_mode_image_folder(tmp_path / "images")
    out = tmp_path / "raw"
    res = run_cli(capsys, "data", "prepare", f"imagefolder:{folder}", "--out", str(out), "--image-size", "12")
    assert res.code == 0, res.err
    for split in ("train", "val"):
        ds = ParquetImageDataset(str(out), split)
        for i, file in enumerate(sample_files(folder, ds)):
            expected = to_uint8_image(Image.open(file), 3).resize((12, 12), Image.BILINEAR)
            assert np.array_equal(ds.raw_image(i), np.asarray(expected)), file
        images, _, _ = ds.batch(range(len(ds)))
        assert images.dtype == torch.uint8 and images.shape == (len(ds), 3, 12, 12)


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    folder = mixed_mode_image_folder(root / "images")
    run_cli_json(
        "data", "prepare", f"imagefolder:{folder}", "--encoded", "--image-size", "16", "--out", str(root / "prepared")
    )
    return root / "prepared"


@pytest.mark.slow
@pytest.mark.parametrize("command, options", [
    ("ddp", ["--num-workers", "1"]),
    ("pipeline", ["--stages", "2", "--microbatches", "2", "--balance", "params"]),  # the first stage's loader decodes
])  # fmt: skip
def test_one_epoch_on_a_mixed_mode_folder(ray_session, mixed_data, tmp_path, command, options):
    result = run_cli_json(
        command, "--no-use-gpu", "--data", str(mixed_data), "--model", "resnet18", "--augment", "--loader-workers", "1",
        "--epochs", "1", "--global-batch-size", "4", "--storage-path", str(tmp_path / "runs"), "--log-every", "0",
        *options,
    )  # fmt: skip
    assert result["epochs"] == 1 and result["val_count"] == 4
