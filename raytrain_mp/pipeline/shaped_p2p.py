"""Tensors of any shape between two ranks: a shape header, then the tensor.

Job: what ``stage``'s eval forward (``predict``, evaluation) sends between ranks, where micro-batches
vary in size (the last validation batch is smaller) and torch's runtime, which sizes its buffers
once per schedule, does not serve. The header holds the number of dimensions, the dtype's code and
up to 8 dimensions; tensors travel contiguous.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# The dtypes an activation may have (bf16 under autocast), by their code in a shape header.
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HEADER = 10  # ndim, dtype code, up to 8 dimensions


def send_shaped(x: Tensor, peer: int, device: torch.device) -> None:
    """Send ``x`` to global rank ``peer``, its header first (from ``device``)."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = x.dim(), _DTYPES.index(x.dtype)
    header[2 : 2 + x.dim()] = torch.tensor(x.shape)
    dist.send(header.to(device), peer)
    dist.send(x.contiguous(), peer)


def recv_shaped(peer: int, device: torch.device) -> Tensor:
    """Receive a tensor that ``send_shaped`` sent from global rank ``peer``, onto ``device``."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, peer)
    ndim, code, *shape = header.tolist()
    x = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(x, peer)
    return x
