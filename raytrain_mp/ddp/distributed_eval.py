"""Distributed evaluation that counts every validation sample exactly once.

``DistributedSampler`` pads the index list with duplicates so every rank gets the same count
(pytorch issue 25162); evaluating through it over-counts up to world_size - 1 samples. torch has
no non-padding variant, hence ``ShardSampler`` here: rank r takes indices r, r + W, r + 2W, ...,
so the ranks' shards are disjoint and cover the split exactly, with counts differing by at most one.
Metrics are summed (loss sum, correct count, sample count) and all-reduced, never averaged per rank.
Sums stay on the device until the end (``all_reduced``): reading a GPU value on the host waits for
every kernel queued before it, so a ``.item()`` per batch would stall the host's copies and launches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler


class ShardSampler(Sampler[int]):
    """Indices ``rank, rank + world_size, ...`` below ``length``: disjoint, covering, unpadded."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


def all_reduced(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the process group in place (unchanged without one), left on its
    device: no host sync, so a step can scale its loss by a global count its GPU has not computed yet."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values)
    return values


def global_count(local: int, device: torch.device) -> torch.Tensor:
    """The sum over the process group of each rank's ``local`` count: a float64 scalar on ``device``
    (``torch.full`` puts it there without a host-to-device copy, which would wait for the stream)."""
    return all_reduced(torch.full((), float(local), dtype=torch.float64, device=device))


def all_reduce_sum(values: list[float | torch.Tensor], device: torch.device) -> list[float]:
    """Sum numbers (plain, or scalars on ``device``) over the process group, in float64; the
    one host sync of the values."""
    return all_reduced(torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])).tolist()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader,
    to_input: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    autocast=nullcontext,
) -> dict[str, float]:
    """Global loss, accuracy and the exact number of samples evaluated across all ranks; the
    loader yields (uint8 images, labels, params) and ``to_input`` makes the model's input of them."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for images, y, params in loader:
        x, y = to_input(images, params), y.to(device, non_blocking=True)
        with autocast():
            logits = model(x)
        loss_sum += nn.functional.cross_entropy(
            logits.to(torch.promote_types(logits.dtype, torch.float32)), y, reduction="sum"
        ).double()
        correct += (logits.argmax(dim=1) == y).sum()
        count += y.numel()
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], device)
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_count": int(count)}
