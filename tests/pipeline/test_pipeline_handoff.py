"""Handing a batch to a stage actor: NumPy views where they exist, the same tensor back."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from raytrain_mp.pipeline.handoff import from_wire, to_wire

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(-12, 12, dtype=torch.float64).view(2, 3, 4)
    return (values > 0) if dtype == torch.bool else values.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_numpy_dtype_travels_as_a_view_and_comes_back_equal(dtype: torch.dtype) -> None:
    tensor = sample(dtype)
    wire = to_wire(tensor)
    assert isinstance(wire, np.ndarray)
    assert wire.ctypes.data == tensor.data_ptr()  # a view: nothing copied on the driver
    back = from_wire(wire)
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_a_replica_share_is_a_view_of_its_rows() -> None:
    batch = torch.arange(24.0).view(6, 4)
    share = batch.chunk(3)[1]
    wire = to_wire(share)
    assert isinstance(wire, np.ndarray) and wire.shape == (2, 4)
    assert torch.equal(from_wire(wire), batch[2:4])


@pytest.mark.parametrize(
    "tensor",
    [
        sample(torch.float32).to(torch.bfloat16),  # NumPy has no bfloat16
        sample(torch.float32).transpose(0, 2),  # not contiguous
        sample(torch.float32).requires_grad_(),
    ],
    ids=["bfloat16", "non-contiguous", "requires-grad"],
)
def test_what_numpy_cannot_hold_travels_as_the_tensor(tensor: torch.Tensor) -> None:
    assert to_wire(tensor) is tensor
    assert from_wire(to_wire(tensor)) is tensor


def test_through_the_object_store_it_arrives_in_place_and_equal(ray_session) -> None:
    ray = ray_session
    batch = torch.randn(64, 3, 32, 32)
    array = ray.get(ray.put(to_wire(batch)))
    # read-only: a view of the object store's buffer, not a copy
    assert isinstance(array, np.ndarray) and not array.flags.writeable
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        back = from_wire(array)
    assert [str(w.message) for w in seen] == []  # torch's read-only warning is silenced
    assert back.dtype == torch.float32 and torch.equal(back, batch)
