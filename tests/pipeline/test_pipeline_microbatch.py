"""Splitting a batch into micro-batches."""

from __future__ import annotations

import pytest
import torch

from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline.microbatch import split_batch


@pytest.mark.parametrize(
    ("batch", "m", "sizes"), [(10, 4, [3, 3, 2, 2]), (12, 4, [3, 3, 3, 3]), (5, 5, [1] * 5), (7, 1, [7])]
)
def test_sizes_weights_and_order(batch: int, m: int, sizes: list[int]) -> None:
    x = torch.arange(batch * 2.0).view(batch, 2)
    y = torch.arange(batch)
    parts = split_batch(x, y, m)
    assert [len(p.inputs) for p in parts] == sizes
    assert [p.index for p in parts] == list(range(m))
    assert [p.weight for p in parts] == [s / batch for s in sizes]
    assert torch.equal(torch.cat([p.inputs for p in parts]), x)
    assert torch.equal(torch.cat([p.targets for p in parts]), y)
    # copies, so that serializing one micro-batch sends only its own samples
    assert all(p.inputs.untyped_storage().nbytes() == p.inputs.nbytes for p in parts)


def test_without_targets() -> None:
    assert [p.targets for p in split_batch(torch.zeros(3, 1), None, 2)] == [None, None]


@pytest.mark.parametrize(
    ("batch", "m", "message"),
    [
        (4, 0, "num_microbatches: need at least 1 micro-batch, got 0"),
        (4, 5, "num_microbatches: 5 micro-batches need a batch of at least 5 samples, got 4"),
    ],
)
def test_errors(batch: int, m: int, message: str) -> None:
    with pytest.raises(UsageError) as info:
        split_batch(torch.zeros(batch, 1), torch.zeros(batch), m)
    assert str(info.value) == message


def test_target_count_must_match() -> None:
    with pytest.raises(UsageError) as info:
        split_batch(torch.zeros(4, 1), torch.zeros(3), 2)
    assert str(info.value) == "targets: 3 targets for 4 inputs"
