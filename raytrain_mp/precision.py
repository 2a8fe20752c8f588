"""What ``--precision`` makes of a forward: the autocast it runs under, as a context or as a module.

Job: ``autocast_for`` gives the context a forward runs under (bf16 or fp16 autocast, else none),
for the DDP loop, ``eval`` and ``predict``; ``Autocast`` wraps a module so that its own forward
runs under one (a pipeline stage, which torch's runtime calls; a model compiled with its autocast
inside the graph). Invariant: the parameters stay in the model's dtype (float32 or float64);
only the operations autocast covers run in the lower precision.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
from torch import Tensor, nn


def autocast_for(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """What a forward runs under: autocast to bf16 or fp16, else nothing."""
    if precision == "bf16":
        return partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return partial(torch.autocast, device_type=device.type, dtype=torch.float16)
    return nullcontext


class Autocast(nn.Module):
    """Runs the wrapped module under ``autocast`` (``autocast_for``'s context)."""

    def __init__(self, module: nn.Module, autocast: Callable[[], AbstractContextManager]) -> None:
        super().__init__()
        self.module, self.autocast = module, autocast

    def forward(self, x: Tensor) -> Tensor:
        with self.autocast():
            return self.module(x)
