"""A torch ``Dataset`` over one split of a prepared data set, read with pyarrow.

Invariants:
- Local shards are memory-mapped, so N worker processes on a node share the page cache instead of
  holding N copies; URIs (s3://, gs://, ...) are read through pyarrow's filesystems.
- Opening validates before any training step: every shard is readable Parquet with the expected
  columns, row counts match the metadata, every label is in [0, num_classes) and every image has
  H*W*C bytes. A bad shard is a one-line ``UsageError`` naming the file.
- Item ``i`` depends only on (``i``, ``seed``, epoch): normalization from the metadata, and, when
  ``augment`` is on, a random crop (zero padding of size/8) and horizontal flip drawn from a
  generator seeded by (seed, epoch, i), so runs are reproducible whatever the worker count.
- The pyarrow table is opened lazily and dropped on pickling, so the object ships cheaply to
  Ray workers and DataLoader worker processes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from raytrain_mp.data.format import SCHEMA, DatasetMeta, read_meta
from raytrain_mp.errors import UsageError
from raytrain_mp.storage import locate


def _read_shard(fs, path: str, display: str) -> pa.Table:
    try:
        if fs.type_name == "local":
            table = pq.read_table(path, memory_map=True)
        else:
            table = pq.read_table(path, filesystem=fs)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UsageError(f"--data: {display} is not a readable Parquet shard (truncated or corrupt?): {exc}") from exc
    missing = [f.name for f in SCHEMA if f.name not in table.column_names]
    if missing:
        raise UsageError(f"--data: {display} lacks the column(s) {', '.join(missing)}; expected {SCHEMA.names}")
    return table


class ParquetImageDataset(Dataset):
    """Samples ``(image, label)``: image a (C, H, W) tensor of ``dtype``, label an int."""

    def __init__(
        self,
        root: str,
        split: str = "train",
        *,
        augment: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        meta: DatasetMeta | None = None,
    ) -> None:
        self.root = str(root)
        self.split = split
        self.augment = augment
        self.seed = seed
        self.dtype = dtype
        self.epoch = 0
        self.meta = meta or read_meta(self.root)
        if split not in self.meta.shards:
            raise UsageError(f"--data: {self.root} has no {split!r} split; it has {sorted(self.meta.shards)}")
        self._mean = np.asarray(self.meta.mean, dtype=np.float64)
        self._std = np.asarray(self.meta.std, dtype=np.float64)
        self._table: pa.Table | None = None
        table = self._open()
        self._labels = table.column("label").to_numpy()
        self._ids = table.column("id").to_numpy()

    def _open(self) -> pa.Table:
        if self._table is not None:
            return self._table
        location = locate(self.root, "--data")
        tables = []
        for name in self.meta.shards[self.split]:
            shard = location.child(self.split, name)
            tables.append(_read_shard(location.fs, shard.path, shard.uri))
        table = pa.concat_tables(tables)
        self._check(table)
        self._table = table
        return table

    def _check(self, table: pa.Table) -> None:
        where = f"{self.root}/{self.split}"
        expected = self.meta.counts[self.split]
        if table.num_rows != expected:
            raise UsageError(f"--data: {where} holds {table.num_rows} rows but metadata says {expected}")
        labels = table.column("label")
        lo, hi = pc.min(labels).as_py(), pc.max(labels).as_py()
        if lo is None or lo < 0 or hi >= self.meta.num_classes:
            raise UsageError(
                f"--data: {where} has labels out of range ({lo}..{hi}); accepted: 0..{self.meta.num_classes - 1}"
            )
        nbytes = int(np.prod(self.meta.image_shape))
        lengths = pc.binary_length(table.column("image"))
        if pc.min(lengths).as_py() != nbytes or pc.max(lengths).as_py() != nbytes:
            raise UsageError(f"--data: {where} has images that are not {self.meta.image_shape} uint8 ({nbytes} bytes)")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_table"] = None
        return state

    def __len__(self) -> int:
        return len(self._labels)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    @property
    def ids(self) -> np.ndarray:
        """Each sample's position in its source."""
        return self._ids

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation draw; call with the sampler's epoch."""
        self.epoch = epoch

    def raw_image(self, index: int) -> np.ndarray:
        """The stored uint8 (H, W, C) image, exactly as prepared."""
        buf = self._open().column("image")[index].as_buffer()
        return np.frombuffer(buf, dtype=np.uint8).reshape(self.meta.image_shape)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = (self.raw_image(index) - self._mean) / self._std  # float64, HWC
        if self.augment:
            image = self._augmented(image, index)
        tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))).to(self.dtype)
        return tensor, int(self._labels[index])

    def _augmented(self, image: np.ndarray, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.epoch, index])
        h, w, _ = image.shape
        pad = max(1, max(h, w) // 8)
        padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
        top, left = rng.integers(0, 2 * pad + 1, size=2)
        image = padded[top : top + h, left : left + w]
        if rng.random() < 0.5:
            image = image[:, ::-1]
        return image


def checked_dataset(data: str | None, batch_size: int, batch_option: str) -> tuple[str, DatasetMeta]:
    """Resolve ``data`` (None: the built-in digits), open and check every shard of both splits, and
    check that one batch of ``batch_size`` fits in the train split. Needs no Ray, so a bad data set
    is reported before any cluster resource is requested."""
    from raytrain_mp.data.default import resolve_dataset

    root = resolve_dataset(data)
    meta = read_meta(root)
    for split in ("train", "val"):
        ParquetImageDataset(root, split, meta=meta)
    if batch_size > meta.counts["train"]:
        raise UsageError(f"{batch_option} {batch_size} exceeds the {meta.counts['train']} training samples")
    return root, meta
