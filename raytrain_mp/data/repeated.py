"""Repeated augmentation (``--ra-sampler``, ``--ra-reps``): an epoch reads each of its samples
``reps`` times, each copy with its own augmentation draws, as torchvision's reference ``RASampler``
(Hoffer et al. 2020; Berman et al. 2019) does.

Job: the epoch's order of *slots*. Slot ``index + r * n`` (r < reps, n training samples) is the
r-th copy of sample ``index``; ``ParquetImageDataset`` reads sample ``slot % n`` and keys every
draw (crop, flip, auto-augment, erasing, mixing partner) by the slot, so copy 0 is drawn exactly as
a run without repetition draws it and every other copy apart.

Invariants:
- An epoch keeps n slots: the first ceil(n / reps) samples of the epoch's permutation, each
  followed by its copies, cut at n (so a global batch holds every copy of most of its samples, as
  the reference's does); steps per epoch, checkpoints and the lr schedule are unchanged.
- The order is a function of (seed, epoch, n, reps) only. torchvision's ``RASampler`` cuts each
  process's share to a multiple of 256 / world size and pads per process, so which samples an
  epoch holds depends on the world size there; here ``RepeatedSampler`` deals the one order to
  ranks as ``DistributedSampler`` deals its permutation, so global batch s is slots
  [s * B, (s + 1) * B) for any worker count, and the pipeline's ``feed.epoch_batches`` cuts the
  same kind of order.
- reps 1 is the plain order: ``RepeatedSampler`` then yields what ``DistributedSampler`` yields.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler


def repeated(order: torch.Tensor, reps: int) -> torch.Tensor:
    """The slots of ``order`` (a permutation of the n samples): each sample, then its ``reps - 1``
    copies (``index + r * n``), the first n of them."""
    n = len(order)
    return (order[:, None] + n * torch.arange(reps)).flatten()[:n]


class RepeatedSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled, seeded by ``seed + epoch``) over the epoch's ``repeated``
    slots: this rank's share, dealt and padded as ``DistributedSampler`` deals its permutation."""

    def __init__(self, dataset: Dataset, reps: int, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.reps = reps

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        slots = repeated(torch.randperm(len(self.dataset), generator=generator), self.reps).tolist()
        while len(slots) < self.total_size:  # DistributedSampler's padding: the order again, from its start
            slots += slots[: self.total_size - len(slots)]
        return iter(slots[self.rank : self.total_size : self.num_replicas])
