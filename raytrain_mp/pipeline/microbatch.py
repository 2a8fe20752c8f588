"""Split a mini-batch into micro-batches the way the pipeline does, for references and checks.

Job: cut inputs and targets along the batch dimension into ``m`` micro-batches and give each its
share of the batch, as torch's pipeline runtime cuts them (``torch.tensor_split``), so that
single-process references (gradient accumulation) and the benchmark's memory model see the same
micro-batches the stages do; and check that a batch can be cut at all. Pure torch.

Invariants:
- Sizes follow ``torch.tensor_split``: the first ``B % m`` micro-batches hold ``B // m + 1``
  samples, the rest ``B // m`` (10 samples, m=4: 3, 3, 2, 2); concatenated they are the batch.
- ``weight`` is the micro-batch's share of the batch, so the weighted sum of per-micro-batch
  mean losses is the batch mean loss and accumulated gradients equal the full-batch gradient.
- Each micro-batch owns its memory (a copy, not a view).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from raytrain_mp.errors import OptionError, UsageError


@dataclass(frozen=True)
class MicroBatch:
    index: int
    inputs: Tensor
    targets: Tensor | None
    weight: float


def check_microbatches(num_microbatches: int, batch_size: int) -> None:
    if num_microbatches < 1:
        raise OptionError("num_microbatches", f"need at least 1 micro-batch, got {num_microbatches}")
    if num_microbatches > batch_size:
        raise OptionError(
            "num_microbatches",
            f"{num_microbatches} micro-batches need a batch of at least {num_microbatches} samples, got {batch_size}",
        )


def split_batch(inputs: Tensor, targets: Tensor | None, num_microbatches: int) -> list[MicroBatch]:
    """``num_microbatches`` micro-batches of ``inputs`` (and ``targets``, if given)."""
    batch_size = len(inputs)
    check_microbatches(num_microbatches, batch_size)
    if targets is not None and len(targets) != batch_size:
        raise UsageError(f"targets: {len(targets)} targets for {batch_size} inputs")
    xs = inputs.tensor_split(num_microbatches)
    ys = targets.tensor_split(num_microbatches) if targets is not None else [None] * num_microbatches
    return [
        MicroBatch(j, x.clone(), None if y is None else y.clone(), len(x) / batch_size)
        for j, (x, y) in enumerate(zip(xs, ys))
    ]
