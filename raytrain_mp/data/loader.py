"""Loader processes: the ``DataLoader`` every training loop reads its uint8 batches from.

Job: read and decode samples in ``workers`` separate processes (torch's ``DataLoader``, which
already does the process pool, prefetch queue and pinned-memory thread well), so the training
process only moves batches to the device and runs ``ParquetImageDataset.transform`` there.

Invariants:
- The sampler runs in the training process and ``EpochKeys`` hands each index over with its
  epoch, so loader processes kept alive across epochs (``persistent_workers``) augment with the
  right epoch without being told, and a batch is the same whatever the process count.
- ``workers`` 0 reads in the training process itself (no processes, no prefetch).
- ``pin`` (on CUDA) puts batches in page-locked memory, so ``non_blocking`` copies overlap compute.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from torch.utils.data import DataLoader, Dataset, Sampler


class EpochKeys(Sampler[tuple[int, int]]):
    """``(epoch, index)`` for every index of ``sampler`` but the first ``skip``; ``set_epoch`` sets
    both (a resumed epoch skips what the checkpointed steps already read)."""

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler = sampler
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, int(i)) for i in itertools.islice(self.sampler, self.skip, None))

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)  # type: ignore[arg-type]


def make_loader(
    dataset: Dataset,
    batch_size: int,
    sampler: Sampler,
    workers: int,
    prefetch: int = 2,
    pin: bool = False,
    persistent: bool = True,
    drop_last: bool = False,
) -> DataLoader:
    """A DataLoader of ``workers`` processes, each keeping ``prefetch`` batches ready; ``persistent``
    keeps them across epochs (a training loader), off for a loader read once an epoch (evaluation)."""
    extra = {"prefetch_factor": prefetch, "persistent_workers": persistent} if workers > 0 else {}
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin,
        drop_last=drop_last,
        **extra,
    )
