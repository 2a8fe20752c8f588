"""Optimizers for every trainer: one construction, whichever strategy runs the model.

Invariant: weight decay applies to conv and linear weights (tensors of two or more dimensions) and
never to BatchNorm parameters or biases (Goyal et al. 2017), so DDP workers, pipeline stages and a
single-process reference build identical optimizers from the same parameters.

torch is imported when an optimizer is built: the command line needs ``OPTIMIZERS`` for its
parser, and ``--help`` must not wait for torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZERS = ("sgd", "adamw")


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in params:
        (decay if p.ndim > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    params: Iterable[nn.Parameter], name: str, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW, over ``params`` grouped by ``param_groups``."""
    import torch

    groups = param_groups(params, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
