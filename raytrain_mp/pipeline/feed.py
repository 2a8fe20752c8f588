"""A pipeline replica's input, read on its own stage actors: the data-set form of ``PipelineTrainer``.

Job: give the first stage of each replica the model inputs, and the last stage the labels, of
that replica's share of every global batch, read from a prepared data set by loader processes on
the stage's node (``data.loader``, as DDP's workers read) and transformed on the stage's device in
the model's dtype, so that the driver's step calls carry positions and learning rates and no
pixels, and the input scales with the replicas and nodes instead of one driver process.

Invariants:
- Sample order is a pure function of (seed, epoch): a seeded permutation of the train split
  (with ``--ra-sampler``, its ``data.repeated`` slots) cut into full global batches
  (``epoch_batches``); replica r of R takes the r-th contiguous equal share of each, the samples
  ``replicas.replica_shares`` gives it of a driver-fed batch. So the run's math depends neither on
  R nor on where the input is read, and a position (epoch, step) names the same samples in every run.
- A stage reads sequentially; asked for another position than the next one (a new epoch, a
  resumed run), it restarts its loader there (``EpochKeys`` skips the steps before), so any
  position can be asked for and every asked step reads its own samples exactly once.
- The first stage decodes images (``StageData.loader_workers`` processes, or in the actor itself
  with 0); the last stage reads only the label column, decoding nothing. ``reads`` counts the
  samples each read, for the tests that check who reads what.
- Validation reads every sample of the val split once, in order, in batches of
  ``StageData.val_batch_size`` (the last one smaller), as the driver's ``DataLoader`` did.
- Training and validation inputs have one shape (``StageData.check``): the stages' runtime is built
  for it, so an encoded data set's training and validation views (``views``) must cut alike.
- The recipe (``StageData.recipe``): the loader draws each sample's auto-augment and erasing box
  by (seed, epoch, index), as DDP's does. With mixup or cutmix each sample comes with its partner
  (``recipe_draws.partner``, by sample and epoch, so never by how the batch is shared); the first
  stage mixes the pixels and the last stage the labels (class probabilities) with the step's one
  draw (``recipe_draws.step_mix``, by (seed, epoch, global step)), so both mix alike without
  telling each other, and whatever the replicas.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Sampler, SequentialSampler

from raytrain_mp.data import ParquetImageDataset, read_meta
from raytrain_mp.data.format import DatasetMeta
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.data.recipe_draws import Mix, Recipe, pair_inputs, partner, step_mix
from raytrain_mp.data.repeated import repeated
from raytrain_mp.errors import UsageError
from raytrain_mp.preprocessing import input_hw
from raytrain_mp.views import Views


@dataclass(frozen=True)
class StageData:
    """Where a pipeline's stages read their batches: the prepared data set at ``root`` (a local or
    shared path, or a URI, as ``--data`` takes), in global batches of ``global_batch_size``
    shuffled by ``seed``, augmented when ``augment`` and by ``recipe``; the first stage of each
    replica decodes with ``loader_workers`` processes (each keeping ``loader_prefetch`` batches
    ready; 0 reads in the stage actor itself) and its Ray bundle reserves a CPU for each."""

    root: str
    global_batch_size: int
    seed: int = 0
    augment: bool = False
    loader_workers: int = 0
    loader_prefetch: int = 2
    val_batch_size: int | None = None  # None: global_batch_size
    preprocess: str | None = None  # the run's --preprocess spec (``preprocessing``): None, data, or the weights'
    recipe: Recipe = Recipe()  # the recipe's options on training samples (``data.recipe_draws``)
    views: Views | None = None  # the run's views of an encoded data set (``views``); None: the data set's own
    reps: int = 1  # --ra-sampler's copies of each sample an epoch reads (``data.repeated``)

    @classmethod
    def of_run(cls, cfg: Any, meta: DatasetMeta) -> StageData:
        """The data of a pipeline command's config, checked against the data set ``meta``."""
        reading = (cfg.data, cfg.global_batch_size, cfg.seed, cfg.augment, cfg.loader_workers, cfg.loader_prefetch)
        views = Views.of(meta, cfg)
        data = cls(*reading, preprocess=cfg.preprocess, recipe=cfg.recipe, views=views, reps=cfg.repetitions)
        data.check(meta)
        return data

    def input_hw(self, meta: DatasetMeta, training: bool = True) -> tuple[int, int]:
        """(H, W) of the model's training (or validation) inputs: the loader's view, then ``preprocess``'s crop."""
        views = self.views or Views.of(meta)
        return input_hw(self.preprocess, *(views.training_hw(self.augment) if training else views.val_hw))

    def check(self, meta: DatasetMeta) -> None:
        if self.loader_workers < 0 or self.loader_prefetch < 1:
            raise UsageError(
                f"data: loader_workers must be >= 0 and loader_prefetch >= 1, got {self.loader_workers} and "
                f"{self.loader_prefetch}"
            )
        if not 1 <= self.global_batch_size <= meta.counts["train"]:
            raise UsageError(
                f"data: global_batch_size {self.global_batch_size} must be between 1 and the {meta.counts['train']} "
                "training samples"
            )
        train, val = self.input_hw(meta), self.input_hw(meta, training=False)
        if train != val:
            raise UsageError(
                f"--val-crop-size: a pipeline's stages take one input shape, but the training views are "
                f"{train[0]}x{train[1]} and the validation views {val[0]}x{val[1]}; accepted: --train-crop-size equal "
                "to --val-crop-size"
            )

    @property
    def val_batch(self) -> int:
        return self.val_batch_size or self.global_batch_size


def epoch_batches(length: int, batch_size: int, seed: int, epoch: int, reps: int = 1) -> list[Tensor]:
    """The epoch's index batches: a seeded permutation (``reps`` > 1: its ``data.repeated`` slots)
    cut into full batches."""
    order = torch.randperm(length, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return list(repeated(order, reps)[: length // batch_size * batch_size].split(batch_size))


def val_batch_sizes(count: int, batch_size: int) -> list[int]:
    """The sizes of the val split's batches in order: full ones, then the rest."""
    return [min(batch_size, count - start) for start in range(0, count, batch_size)]


class ShareSampler(Sampler[int]):
    """Replica ``replica``'s share of every full global batch of the epoch, batch after batch."""

    def __init__(
        self, length: int, global_batch: int, seed: int, num_replicas: int, replica: int, reps: int = 1
    ) -> None:
        self.length, self.global_batch, self.seed, self.reps = length, global_batch, seed, reps
        self.share = global_batch // num_replicas
        self.start = replica * self.share
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for batch in epoch_batches(self.length, self.global_batch, self.seed, self.epoch, self.reps):
            yield from batch[self.start : self.start + self.share].tolist()

    def __len__(self) -> int:
        return self.length // self.global_batch * self.share


class StageFeed:
    """The input of one stage actor of ``replica`` (of ``num_replicas``): images made model inputs
    on ``device`` in ``dtype`` when it holds the first stage (``images``), labels when it holds the
    last (``labels``)."""

    def __init__(
        self,
        data: StageData,
        replica: int,
        num_replicas: int,
        device: torch.device,
        dtype: torch.dtype,
        images: bool,
        labels: bool,
    ) -> None:
        meta = read_meta(data.root)
        self.data = data
        self.share = data.global_batch_size // num_replicas
        self.start = replica * self.share
        train = ParquetImageDataset(
            data.root, "train", augment=data.augment, seed=data.seed, meta=meta, preprocess=data.preprocess,
            recipe=data.recipe, views=data.views,
        )  # fmt: skip
        val = ParquetImageDataset(data.root, "val", meta=meta, preprocess=data.preprocess, views=data.views)
        self._train_labels, self._val_labels = torch.tensor(train.labels), torch.tensor(val.labels)
        self._length = len(train)
        self._num_classes, self._dtype = meta.num_classes, dtype
        self._input_hw = data.input_hw(meta)  # the model input's, as mixing draws on it
        self.reads = 0  # samples this actor read (partners too): images on the first stage, else labels
        self._images = images
        self._labels = labels
        self._next: tuple[int, int] | None = None  # the position the open train iterator reads next
        self._batches = None
        self._order: tuple[int, list[Tensor]] | None = None  # (epoch, its index batches)
        if images:
            loading = {"workers": data.loader_workers, "prefetch": data.loader_prefetch, "pin": device.type == "cuda"}
            self._sampler = EpochKeys(
                ShareSampler(len(train), data.global_batch_size, data.seed, num_replicas, replica, data.reps)
            )
            self._train_loader = make_loader(train, self.share, self._sampler, **loading)
            self._val_loader = make_loader(
                val, data.val_batch, EpochKeys(SequentialSampler(val)), **loading, persistent=False
            )
            self._to_input = partial(train.transform, device=device, dtype=dtype)
            self._to_val_input = partial(val.transform, device=device, dtype=dtype)

    def batch(self, epoch: int, step: int) -> tuple[Tensor | None, Tensor | None]:
        """(model inputs on the first stage, labels on the last; None where not held) of this
        replica's share of global step ``step`` of ``epoch``."""
        inputs = labels = None
        if self._images:
            if self._next != (epoch, step):
                self._sampler.set_epoch(epoch, skip=step * self.share)
                self._batches = iter(self._train_loader)
            images, _, params = next(self._batches)
            self._next = (epoch, step + 1)
            if self.data.recipe.mixing:  # images (N, 2, C, H, W): each sample, then its partner
                x = pair_inputs(self._to_input, images, params)
                inputs = self._mix(epoch, step).images(x[:, 0], x[:, 1])
            else:
                inputs = self._to_input(images, params)
        if self._labels:
            indices = self._share_indices(epoch, step)
            labels = self._train_labels[indices % self._length]  # a slot of --ra-sampler reads its sample
            if self.data.recipe.mixing:
                mates = [partner(self.data.seed, epoch, int(i), self._length) for i in indices]
                labels = self._mix(epoch, step).targets(
                    labels, self._train_labels[mates], self._num_classes, self._dtype
                )
        self.reads += self.share * (1 + self.data.recipe.mixing)
        return inputs, labels

    def _mix(self, epoch: int, step: int) -> Mix:
        """Global step ``step`` of ``epoch``'s mixing: the same draw on the first and the last stage."""
        recipe, steps_per_epoch = self.data.recipe, self._length // self.data.global_batch_size
        global_step = epoch * steps_per_epoch + step
        return step_mix(recipe.mixup_alpha, recipe.cutmix_alpha, self._input_hw, self.data.seed, epoch, global_step)

    def _share_indices(self, epoch: int, step: int) -> Tensor:
        if self._order is None or self._order[0] != epoch:
            batches = epoch_batches(self._length, self.data.global_batch_size, self.data.seed, epoch, self.data.reps)
            self._order = (epoch, batches)
        return self._order[1][step][self.start : self.start + self.share]

    def val_batches(self):
        """Each val batch in order: (model inputs or None, labels or None)."""
        batches = self._val_loader if self._images else itertools.repeat(None)
        start = 0
        for size, batch in zip(val_batch_sizes(len(self._val_labels), self.data.val_batch), batches):
            self.reads += size
            inputs = self._to_val_input(batch[0], batch[2]) if self._images else None
            yield inputs, self._val_labels[start : start + size] if self._labels else None
            start += size


def val_chunks(count: int, batch_size: int, num_microbatches: int) -> list[int]:
    """How many micro-batches each val batch runs in: m, or fewer for a batch smaller than m."""
    return [min(num_microbatches, size) for size in val_batch_sizes(count, batch_size)]
