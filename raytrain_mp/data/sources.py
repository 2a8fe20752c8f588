"""Read the supported sources into memory as uint8 HWC arrays: digits, synthetic, CIFAR-10, ImageFolder.

Each reader returns a ``RawDataset`` and knows nothing of Parquet. Invariants: images are uint8 of
shape (N, H, W, C), labels int64 in [0, num_classes), ``ids`` are each sample's position in its
source (so a prepared set can be traced back), and every seeded split or synthetic draw is a pure
function of its arguments. Bad inputs raise ``UsageError`` naming the path and the expected layout.

An encoded ImageFolder (``encoded_size`` set) holds each file's bytes instead (an object array of
``bytes``), every file decoded once to check it, and ``stats`` carries the train split's
per-channel mean and std, merged from per-image moments (Chan et al.), since the pixels are not kept.
Both kinds of ImageFolder make each file 8-bit RGB with ``data.pixels`` (whatever its mode: 16-bit,
palette, CMYK, alpha, ...), so the statistics are of the very pixels that training sees.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytrain_mp.errors import UsageError

SOURCES = ("digits", "synthetic", "cifar10:PATH", "imagefolder:PATH")


@dataclass
class RawSplit:
    images: np.ndarray  # (N, H, W, C) uint8
    labels: np.ndarray  # (N,) int64
    ids: np.ndarray  # (N,) int64, position in the source


@dataclass
class RawDataset:
    source: str
    train: RawSplit
    val: RawSplit
    class_names: list[str]
    encoded_size: int | None = None  # encoded: the side images are decoded and cropped to
    stats: tuple[list[float], list[float]] | None = None  # encoded: train mean and std per channel


def seeded_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and val index arrays of a seeded random split stratified by class: val takes
    ``round(n * val_fraction)`` samples, as an unstratified split did, shared out among the classes
    in proportion to their sizes (each gets ``floor(n_c * val_fraction)``, and the ones left go to
    the largest remainders, the first class on a tie: 3 classes of 40 at 0.2 give 8, 8 and 8),
    drawn within each class by a generator seeded with ``seed``; both splits non-empty or an error.
    Data sets prepared before the split was stratified keep theirs: it is in their shards."""
    labels = np.asarray(labels)
    n_val = int(round(len(labels) * val_fraction))
    if n_val < 1 or n_val >= len(labels):
        raise UsageError(
            f"--val-fraction {val_fraction} of {len(labels)} samples leaves an empty train or val split; "
            "accepted: a fraction that gives both at least one sample"
        )
    classes = np.unique(labels)
    members = [np.flatnonzero(labels == c) for c in classes]
    quota = np.array([len(m) for m in members]) * val_fraction
    take = np.floor(quota).astype(np.int64)
    take[np.argsort(-(quota - take), kind="stable")[: n_val - take.sum()]] += 1
    rng = np.random.default_rng(seed)
    val = np.sort(np.concatenate([rng.permutation(m)[:k] for m, k in zip(members, take)]))
    return np.setdiff1d(np.arange(len(labels)), val), val


def _split(source: str, images, labels, class_names, val_fraction: float, seed: int) -> RawDataset:
    ids = np.arange(len(labels), dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    tr, va = seeded_split(labels, val_fraction, seed)
    return RawDataset(
        source,
        RawSplit(images[tr], labels[tr], ids[tr]),
        RawSplit(images[va], labels[va], ids[va]),
        class_names,
    )


def _presplit(source: str, tr_x, tr_y, va_x, va_y, class_names: list[str]) -> RawDataset:
    """A source that comes split already; ids count within each split."""
    return RawDataset(
        source,
        RawSplit(tr_x, tr_y, np.arange(len(tr_y), dtype=np.int64)),
        RawSplit(va_x, va_y, np.arange(len(va_y), dtype=np.int64)),
        class_names,
    )


def load_digits_source(val_fraction: float = 0.2, seed: int = 0) -> RawDataset:
    """scikit-learn's bundled 1,797 8x8 digits, pixel values 0..16 stored as they are."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.uint8)[..., None]
    return _split("digits", images, digits.target, [str(c) for c in range(10)], val_fraction, seed)


def make_synthetic_source(
    num_samples: int = 2048,
    image_size: int = 32,
    num_classes: int = 10,
    channels: int = 3,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> RawDataset:
    """Seeded images with learnable class structure: a smooth per-class prototype plus noise."""
    rng = np.random.default_rng(seed)
    # Prototypes are upsampled from a coarse grid so classes differ in shape, not only in pixel noise.
    coarse = max(2, image_size // 4)
    grid = rng.uniform(40, 215, size=(num_classes, coarse, coarse, channels))
    reps = -(-image_size // coarse)
    protos = np.repeat(np.repeat(grid, reps, axis=1), reps, axis=2)[:, :image_size, :image_size]
    labels = rng.integers(0, num_classes, size=num_samples)
    noise = rng.normal(0.0, 30.0, size=(num_samples, image_size, image_size, channels))
    images = np.clip(protos[labels] + noise, 0, 255).astype(np.uint8)
    names = [f"class_{c}" for c in range(num_classes)]
    return _split("synthetic", images, labels, names, val_fraction, seed)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise UsageError(f"cifar10: {path} is not a CIFAR-10 python pickle batch ({exc})") from exc


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle(path)
    if b"data" not in batch or b"labels" not in batch:
        raise UsageError(f"cifar10: {path} lacks the keys b'data' and b'labels' of a CIFAR-10 batch")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != len(batch[b"labels"]):
        raise UsageError(f"cifar10: {path} data has shape {data.shape}; expected (N, 3072) with N labels")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), np.asarray(batch[b"labels"], dtype=np.int64)


def load_cifar10_source(path: str) -> RawDataset:
    """The python-pickle batches of the CIFAR-10 tarball: data_batch_1..5 train, test_batch val."""
    root = Path(path).expanduser()  # the shell leaves a ~ after "cifar10:" alone
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    if not root.is_dir():
        raise UsageError(f"cifar10: no such folder {path}")
    train_files = sorted(root.glob("data_batch_*"))
    if not train_files or not (root / "test_batch").is_file():
        raise UsageError(
            f"cifar10: {path} is not an extracted CIFAR-10 python folder; expected data_batch_1..5 and test_batch"
        )
    names = [str(c) for c in range(10)]
    if (root / "batches.meta").is_file():
        meta = _unpickle(root / "batches.meta")
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta.get(b"label_names", names)]
    parts = [_cifar_batch(f) for f in train_files]
    tr_x = np.concatenate([p[0] for p in parts])
    tr_y = np.concatenate([p[1] for p in parts])
    va_x, va_y = _cifar_batch(root / "test_batch")
    for y in (tr_y, va_y):
        if y.size and (y.min() < 0 or y.max() >= len(names)):
            raise UsageError(f"cifar10: labels out of range in {path}; accepted: 0..{len(names) - 1}")
    return _presplit("cifar10", tr_x, tr_y, va_x, va_y, names)


def _image_folder(root: Path):
    from torchvision.datasets import ImageFolder

    try:
        return ImageFolder(str(root))
    except (FileNotFoundError, RuntimeError) as exc:
        raise UsageError(
            f"imagefolder: {root} is not an ImageFolder tree (one sub-folder of images per class): {exc}"
        ) from exc


def _read_imagefolder(root: Path, image_size: int | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    from PIL import Image, UnidentifiedImageError

    from raytrain_mp.data.pixels import to_uint8_image

    folder = _image_folder(root)
    images = []
    first_shape = None
    for file, _ in folder.samples:
        try:
            with Image.open(file) as im:
                im = to_uint8_image(im, 3)
                if image_size is not None:
                    im = im.resize((image_size, image_size), Image.BILINEAR)
                arr = np.asarray(im, dtype=np.uint8)
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
            raise UsageError(f"imagefolder: cannot read image {file} ({exc})") from exc
        if first_shape is None:
            first_shape = (arr.shape, file)
        elif arr.shape != first_shape[0]:
            raise UsageError(
                f"imagefolder: {file} is {arr.shape[1]}x{arr.shape[0]} but {first_shape[1]} is "
                f"{first_shape[0][1]}x{first_shape[0][0]}; pass --image-size N to resize all images"
            )
        images.append(arr)
    labels = np.asarray(folder.targets, dtype=np.int64)
    return np.stack(images), labels, list(folder.classes)


def _read_encoded(root: Path) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Files as bytes, labels, class names, and per image (pixel count, channel means, channel M2)."""
    from raytrain_mp.data.encoded import check_file

    folder = _image_folder(root)
    files, moments = [], []
    for file, _ in folder.samples:
        pixels = check_file(file).reshape(-1, 3).astype(np.float64)
        mean = pixels.mean(axis=0)
        moments.append(np.concatenate([[len(pixels)], mean, ((pixels - mean) ** 2).sum(axis=0)]))
        files.append(Path(file).read_bytes())
    data = np.empty(len(files), dtype=object)
    data[:] = files
    return data, np.asarray(folder.targets, dtype=np.int64), list(folder.classes), np.stack(moments)


def merged_stats(moments: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-channel mean and std over all pixels of the images whose rows of moments are given."""
    counts, means, m2s = moments[:, :1], moments[:, 1:4], moments[:, 4:]
    total = counts.sum()
    mean = (counts * means).sum(axis=0) / total
    std = np.sqrt((m2s.sum(axis=0) + (counts * (means - mean) ** 2).sum(axis=0)) / total)
    return mean.tolist(), np.where(std > 0, std, 1.0).tolist()


def load_encoded_imagefolder_source(
    path: str, val_fraction: float = 0.2, seed: int = 0, image_size: int = 224
) -> RawDataset:
    """An ImageFolder kept as its JPEG and PNG files, every one checked; layout as ``load_imagefolder_source``."""
    root = _imagefolder_root(path)
    if (root / "train").is_dir() and (root / "val").is_dir():
        tr_x, tr_y, names, tr_m = _read_encoded(root / "train")
        va_x, va_y, va_names, _ = _read_encoded(root / "val")
        if va_names != names:
            raise UsageError(f"imagefolder: {root}/train and {root}/val have different class folders")
        raw = _presplit("imagefolder", tr_x, tr_y, va_x, va_y, names)
        train_moments = tr_m
    else:
        files, labels, names, moments = _read_encoded(root)
        raw = _split("imagefolder", files, labels, names, val_fraction, seed)
        train_moments = moments[raw.train.ids]
    raw.encoded_size, raw.stats = image_size, merged_stats(train_moments)
    return raw


def _imagefolder_root(path: str) -> Path:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UsageError(f"imagefolder: no such folder {path}")
    return root


def load_imagefolder_source(
    path: str, val_fraction: float = 0.2, seed: int = 0, image_size: int | None = None
) -> RawDataset:
    """torchvision's ImageFolder layout: PATH/CLASS/IMAGE, or PATH/train/CLASS/... and PATH/val/CLASS/..."""
    root = _imagefolder_root(path)
    if (root / "train").is_dir() and (root / "val").is_dir():
        tr_x, tr_y, names = _read_imagefolder(root / "train", image_size)
        va_x, va_y, va_names = _read_imagefolder(root / "val", image_size)
        if va_names != names:
            raise UsageError(f"imagefolder: {root}/train and {root}/val have different class folders")
        if tr_x.shape[1:] != va_x.shape[1:]:
            raise UsageError("imagefolder: train and val images differ in size; pass --image-size N")
        return _presplit("imagefolder", tr_x, tr_y, va_x, va_y, names)
    images, labels, names = _read_imagefolder(root, image_size)
    return _split("imagefolder", images, labels, names, val_fraction, seed)
