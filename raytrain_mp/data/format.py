"""The on-disk format of a prepared data set, and the checks that a folder really is one.

Layout of a data set folder (local path or a pyarrow/fsspec URI such as ``s3://bucket/digits``)::

    metadata.json            DatasetMeta below
    train/part-00000.parquet one row per sample: image (binary: raw uint8 H*W*C bytes, HWC order;
                                                 or, when ``encoded``, the JPEG or PNG file as is),
    val/part-00000.parquet                       label (int64 in [0, num_classes)),
                                                 id (int64, the sample's position in its source)

Invariants: ``metadata.json`` is written last, after every shard, so a folder with metadata is
complete; the per-channel ``mean``/``std`` are of the train split in raw pixel units (no /255), so a
trainer normalizes with them and nothing else; ``counts`` equals the rows in each split's shards.
``image_shape`` is the shape training sees: the stored shape of raw images, and for encoded ones
(``encoded`` true) the square that decoding crops them to, whatever each file's own size.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_mp.errors import UsageError
from raytrain_mp.storage import locate

FORMAT_VERSION = 1
META_FILE = "metadata.json"
SPLITS = ("train", "val")
SCHEMA = pa.schema([("image", pa.binary()), ("label", pa.int64()), ("id", pa.int64())])


@dataclass
class DatasetMeta:
    source: str
    image_shape: tuple[int, int, int]  # H, W, C
    num_classes: int
    class_names: list[str]
    mean: list[float]
    std: list[float]
    counts: dict[str, int]
    shards: dict[str, list[str]] = field(default_factory=dict)  # split -> file names in order
    encoded: bool = False  # image column holds JPEG/PNG files (decoded in the loader), not raw pixels
    # split -> samples per class, in class order; None in data sets prepared before it was written
    class_counts: dict[str, list[int]] | None = None
    format_version: int = FORMAT_VERSION

    @property
    def channels(self) -> int:
        return self.image_shape[2]

    @property
    def image_size(self) -> int:
        return max(self.image_shape[0], self.image_shape[1])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def read_meta(root: str) -> DatasetMeta:
    """Read and check ``metadata.json`` of a prepared data set folder."""
    location = locate(str(root), "--data")
    fs, path = location.fs, location.path
    meta_path = f"{path.rstrip('/')}/{META_FILE}"
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise UsageError(f"--data: no such data set folder {root}; create one with `raytrain-mp data prepare`")
    if fs.get_file_info(meta_path).type != pafs.FileType.File:
        raise UsageError(
            f"--data: {root} holds no {META_FILE}; not a prepared data set (run `raytrain-mp data prepare`)"
        )
    try:
        with fs.open_input_stream(meta_path) as f:
            raw = json.loads(f.read().decode("utf-8"))
        raw["image_shape"] = tuple(int(v) for v in raw["image_shape"])
        meta = DatasetMeta(**raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--data: {meta_path} is not a valid data set metadata file ({exc})") from exc
    if meta.format_version != FORMAT_VERSION:
        raise UsageError(f"--data: {root} has format version {meta.format_version}; this tool reads {FORMAT_VERSION}")
    for split in SPLITS:
        if meta.counts.get(split, 0) < 1:
            raise UsageError(f"--data: {root} has an empty {split} split")
    return meta
