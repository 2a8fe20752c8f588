"""The driver's hand-off of a batch to the stage actors: CPU tensors travel as NumPy views, zero-copy.

Job: ``to_wire`` turns a tensor the driver passes to a Ray actor call into what Ray serializes
cheapest, and ``from_wire`` turns it back into a tensor on the actor.

Why not Ray's default: Ray pickles a ``torch.Tensor`` through torch's own reducer, which copies the
storage into a byte string on the driver and out of it on the actor. A NumPy array instead rides
pickle 5's out-of-band buffers: one copy into the object store, and the actor reads it in place
(the figures: docs/performance.md, "the hand-off"). Ray's ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``
does the same, but for every tensor of the process (state dicts included) and is marked
experimental; this module does it for the batch only.

Invariants:
- ``from_wire(to_wire(t))`` equals ``t`` in values, dtype and shape. A tensor NumPy cannot hold
  (bfloat16, a non-CPU device) or a non-contiguous one travels as a tensor, the default way.
- The tensor ``from_wire`` returns shares the object store's memory: the stage only reads it (its
  first module's input, the loss's targets). The driver's own tensor is never shared: Ray copied
  it into the object store when the call was made.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

# The dtypes whose NumPy view holds the same bytes and comes back as the same torch dtype.
_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


def to_wire(tensor: Tensor) -> np.ndarray | Tensor:
    """What to put in the actor call for ``tensor``: a NumPy view of it where one exists."""
    if (
        tensor.device.type == "cpu"
        and tensor.dtype in _NUMPY_DTYPES
        and tensor.is_contiguous()
        and not tensor.requires_grad
    ):
        return tensor.numpy()
    return tensor


def from_wire(value: np.ndarray | Tensor) -> Tensor:
    """The tensor ``to_wire`` sent, on the receiving actor."""
    if isinstance(value, Tensor):
        return value
    with warnings.catch_warnings():
        # The array is read-only (it lives in the object store); torch warns that it cannot mark
        # the tensor so. The stage never writes it (see the invariants).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(value)
