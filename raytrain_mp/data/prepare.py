"""Write a source into the Parquet shard format, atomically.

Invariants: everything is written into a temporary sibling folder of ``out`` and renamed into place
only when every shard and ``metadata.json`` are complete, so a failure (bad input, full disk, Ctrl-C)
never leaves a half-written ``out``. Statistics are computed in float64 over the train split, of
the stored pixels or, for encoded files, of the pixels the loader decodes (both made by ``data.pixels``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_mp.data.format import META_FILE, SCHEMA, DatasetMeta
from raytrain_mp.data.sources import (
    SOURCES,
    RawDataset,
    RawSplit,
    load_cifar10_source,
    load_digits_source,
    load_encoded_imagefolder_source,
    load_imagefolder_source,
    make_synthetic_source,
)
from raytrain_mp.errors import UsageError
from raytrain_mp.storage import (
    Location,
    check_reachable,
    delete_folder,
    is_uri,
    locate,
    make_ordinary,
    publish_folder,
)

ENCODED_SIZE = 224  # the ImageNet recipe's crop, when --encoded comes without --image-size


def load_source(
    spec: str,
    *,
    val_fraction: float = 0.2,
    seed: int = 0,
    num_samples: int = 2048,
    image_size: int | None = None,
    num_classes: int = 10,
    channels: int = 3,
    encoded: bool = False,
) -> RawDataset:
    """Dispatch a SOURCE argument (``digits``, ``synthetic``, ``cifar10:PATH``, ``imagefolder:PATH``)."""
    kind, _, path = spec.partition(":")
    if encoded and kind == "imagefolder" and path:
        return load_encoded_imagefolder_source(path, val_fraction, seed, image_size or ENCODED_SIZE)
    if kind == "digits" and not path:
        return load_digits_source(val_fraction, seed)
    if kind == "synthetic" and not path:
        return make_synthetic_source(num_samples, image_size or 32, num_classes, channels, val_fraction, seed)
    if kind == "cifar10" and path:
        return load_cifar10_source(path)
    if kind == "imagefolder" and path:
        return load_imagefolder_source(path, val_fraction, seed, image_size)
    raise UsageError(f"SOURCE: unknown source {spec!r}; accepted: {', '.join(SOURCES)}")


def _channel_stats(images: np.ndarray) -> tuple[list[float], list[float]]:
    flat = images.reshape(-1, images.shape[-1]).astype(np.float64)
    std = flat.std(axis=0)
    return flat.mean(axis=0).tolist(), np.where(std > 0, std, 1.0).tolist()


def _write_split(split: RawSplit, folder: Path, rows_per_shard: int) -> list[str]:
    folder.mkdir()
    names = []
    for shard, start in enumerate(range(0, len(split.labels), rows_per_shard)):
        stop = start + rows_per_shard
        images = split.images[start:stop]
        table = pa.table(
            {
                "image": pa.array([im if isinstance(im, bytes) else im.tobytes() for im in images], type=pa.binary()),
                "label": pa.array(split.labels[start:stop], type=pa.int64()),
                "id": pa.array(split.ids[start:stop], type=pa.int64()),
            },
            schema=SCHEMA,
        )
        name = f"part-{shard:05d}.parquet"
        pq.write_table(table, folder / name)
        names.append(name)
    return names


def write_dataset(
    raw: RawDataset, out: str | Path, rows_per_shard: int = 10_000, overwrite: bool = False
) -> DatasetMeta:
    """Write ``raw`` as shards + metadata into ``out`` (a local folder or a URI), replacing it only if asked.

    On an object store the data set is written locally, then uploaded with ``metadata.json`` last
    (the format's completeness mark); a replaced one loses its metadata first."""
    if is_uri(str(out)):
        return _upload_dataset(raw, locate(str(out), "--out"), rows_per_shard, overwrite)
    out = Path(out)
    if rows_per_shard < 1:
        raise UsageError(f"--rows-per-shard must be >= 1, got {rows_per_shard}")
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out: {out} already exists and is not empty; choose a new folder or pass --overwrite")
    for name, split in (("train", raw.train), ("val", raw.val)):
        if len(split.labels) == 0:
            raise UsageError(f"{raw.source}: the {name} split is empty")
        if split.labels.min() < 0 or split.labels.max() >= len(raw.class_names):
            raise UsageError(f"{raw.source}: labels out of range; accepted: 0..{len(raw.class_names) - 1}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if raw.encoded_size is not None:
            (mean, std), image_shape = raw.stats, (raw.encoded_size, raw.encoded_size, 3)
        else:
            mean, std = _channel_stats(raw.train.images)
            image_shape = tuple(int(v) for v in raw.train.images.shape[1:])
        meta = DatasetMeta(
            source=raw.source,
            image_shape=image_shape,
            encoded=raw.encoded_size is not None,
            num_classes=len(raw.class_names),
            class_names=list(raw.class_names),
            mean=mean,
            std=std,
            counts={"train": int(len(raw.train.labels)), "val": int(len(raw.val.labels))},
            class_counts={
                name: np.bincount(split.labels, minlength=len(raw.class_names)).tolist()
                for name, split in (("train", raw.train), ("val", raw.val))
            },
            shards={
                "train": _write_split(raw.train, tmp / "train", rows_per_shard),
                "val": _write_split(raw.val, tmp / "val", rows_per_shard),
            },
        )
        (tmp / META_FILE).write_text(meta.to_json())
        make_ordinary(tmp)  # tempfile.mkdtemp made it private
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(trash / "old")
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _upload_dataset(raw: RawDataset, target: Location, rows_per_shard: int, overwrite: bool) -> DatasetMeta:
    check_reachable(target, "--out")
    if target.exists() and not overwrite and target.fs.get_file_info(pafs.FileSelector(target.path)):
        raise UsageError(
            f"--out: {target.uri} already exists and is not empty; choose a new folder or pass --overwrite"
        )
    staging = Path(tempfile.mkdtemp(prefix="raytrain-data-"))
    try:
        meta = write_dataset(raw, staging / "dataset", rows_per_shard)
        if target.exists():
            delete_folder(target, marker=META_FILE)
        publish_folder(staging / "dataset", target, last=META_FILE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta


def prepare(
    spec: str, out: str | Path, *, rows_per_shard: int = 10_000, overwrite: bool = False, **source_options
) -> DatasetMeta:
    """Read SOURCE and write it to ``out``: the ``raytrain-mp data prepare`` command's work."""
    return write_dataset(load_source(spec, **source_options), out, rows_per_shard, overwrite)
