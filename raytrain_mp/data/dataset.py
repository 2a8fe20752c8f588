"""A torch ``Dataset`` over one split of a prepared data set, read with pyarrow.

Invariants:
- Local shards are memory-mapped, so N worker processes on a node share the page cache instead of
  holding N copies; URIs (s3://, gs://, ...) are read through pyarrow's filesystems.
- Opening validates before any training step: every shard is readable Parquet with the expected
  columns, row counts match the metadata, every label is in [0, num_classes) and every image has
  H*W*C bytes. A bad shard is a one-line ``UsageError`` naming the file.
- An item is ``(image, label, params)``: the image as uint8 (C, H, W), never normalized here (that
  is ``transform``'s job, batched on the training device), and ``params`` the int64 (top, left,
  flip, then random erasing's box) of its augmentation. A ``recipe`` (``data.recipe_draws``) adds
  its auto-augment policy (applied here, to the uint8 image) and erasing box, and, for a run that
  mixes, makes every item two: the sample and its partner, stacked (images (2, C, H, W), labels
  (2,), params (2, PARAMS)). Item ``i`` depends only on (``i``, ``seed``, epoch): the draws come
  from ``data.augment``, keyed by (seed, epoch, i), so runs are reproducible whatever the number
  of workers or loader processes. A key may be ``(epoch, i)`` (what ``data.loader.EpochKeys``
  yields), so loader processes that outlive an epoch need no ``set_epoch`` of their own.
- Raw images (``meta.encoded`` false) are stored at their training size: augmentation is a crop
  of the zero-padded image and a flip. Encoded images are decoded here (in the loader process)
  to the run's ``views`` (``views``) by ``data.encoded``: RandomResizedCrop for training
  (``augment``), Resize + CenterCrop otherwise; their flip is left to ``transform``.
- The pyarrow table is opened lazily and dropped on pickling, so the object ships cheaply to
  Ray workers and DataLoader worker processes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, default_collate

from raytrain_mp.data.augment import pad_crop, pad_width
from raytrain_mp.data.encoded import train_view, val_view
from raytrain_mp.data.format import SCHEMA, DatasetMeta, read_meta
from raytrain_mp.data.recipe_draws import Recipe, augmented, erase_box, partner
from raytrain_mp.data.transforms import BatchTransform
from raytrain_mp.errors import UsageError
from raytrain_mp.preprocessing import input_hw
from raytrain_mp.storage import locate
from raytrain_mp.views import Views


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
    """Samples ``(image, label, params)``: uint8 (C, H, W), an int, int64 (top, left, flip)."""

    def __init__(
        self,
        root: str,
        split: str = "train",
        *,
        augment: bool = False,
        seed: int = 0,
        meta: DatasetMeta | None = None,
        preprocess: str | None = None,
        recipe: Recipe | None = None,
        views: Views | None = None,
    ) -> None:
        self.root = str(root)
        self.recipe = recipe or Recipe()
        self._policy = self.recipe.policy()
        self.preprocess = preprocess  # the run's --preprocess spec (``preprocessing``): None, data, or the weights'
        self.split = split
        self.augment = augment
        self.seed = seed
        self.epoch = 0
        self.meta = meta or read_meta(self.root)
        self.views = views or Views.of(self.meta)
        if split not in self.meta.shards:
            raise UsageError(f"--data: {self.root} has no {split!r} split; it has {sorted(self.meta.shards)}")
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
        if self.meta.encoded:
            return  # each file has its own size; data prepare decoded every one
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

    @property
    def transform(self) -> BatchTransform:
        """What turns a batch of these items into the model's input on the training device."""
        h, w, _ = self.meta.image_shape
        pad = 0 if self.meta.encoded else pad_width(h, w)
        return BatchTransform.for_run(self.meta, self.preprocess, pad, self.augment, self.recipe.random_erase > 0)

    def stored(self, index: int) -> bytes:
        """The image column's bytes of one sample: raw HWC pixels, or an encoded file."""
        return self._open().column("image")[index].as_py()

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int | torch.Tensor, torch.Tensor]:
        epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
        if not self.recipe.mixing:
            return self.sample(epoch, index)
        own, mate = self.sample(epoch, index), self.sample(epoch, partner(self.seed, epoch, index, len(self)))
        return torch.stack([own[0], mate[0]]), torch.tensor([own[1], mate[1]]), torch.stack([own[2], mate[2]])

    def sample(self, epoch: int, index: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Sample ``index`` as ``epoch`` draws it: (uint8 image, label, params). An ``index`` of n or
        more is a repeated augmentation's slot (``data.repeated``): sample ``index % n``, its draws
        keyed by the slot."""
        slot, index = index, index % len(self)
        label = int(self._labels[index])
        crop = torch.zeros(3, dtype=torch.int64)
        if self.meta.encoded:
            views = self.views
            if self.augment:
                size = views.train_hw[0]
                image, flip = train_view(self.stored(index), size, self.seed, epoch, slot, views.interpolation)
                crop[2] = flip
            else:
                image = val_view(self.stored(index), views)
        else:
            # A copy: arrow's buffer is read-only, and the collated batch wants its own memory anyway.
            image = torch.from_numpy(self.raw_image(index).transpose(2, 0, 1).copy())
            if self.augment:
                h, w, _ = self.meta.image_shape
                crop = torch.tensor(pad_crop(self.seed, epoch, slot, h, w))
        if self._policy is not None:
            image = augmented(self._policy, image, self.seed, epoch, slot)
        box = (0, 0, 0, 0)
        if self.recipe.random_erase:  # drawn on the model's input: the image, or the preprocessing's crop
            shape = (image.shape[0], *input_hw(self.preprocess, *image.shape[1:]))
            box = erase_box(self.recipe.random_erase, shape, self.seed, epoch, slot)
        return image, label, torch.cat([crop, torch.tensor(box)])

    def batch(self, keys: Iterable[int | tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The items of ``keys`` collated as a loader would: (uint8 images, labels, params)."""
        return default_collate([self[key] for key in keys])


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
