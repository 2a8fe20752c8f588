"""Optimizers for every trainer: one construction, whichever strategy runs the model.

Invariants: ``weight_decay`` applies to conv and linear weights (tensors of two or more dimensions),
and ``norm_weight_decay`` (``--norm-weight-decay``, default 0: none, Goyal et al. 2017) to the
rest: normalization layers' weights and biases, and every bias, so DDP workers, pipeline stages and
a single-process reference build identical optimizers from the same parameters. (torchvision's
reference ``train.py`` has the same option for normalization layers, and decays other biases with
``--weight-decay`` unless its ``--bias-weight-decay`` says otherwise; ResNets' one such bias is the
head's.) A per-parameter
``lr_scale`` (fine-tuning's lower backbone lr, ``finetune.lr_scales``) splits the groups further by
scale and sets each group's lr to ``lr * scale``; without one the groups are the two above.

torch is imported when an optimizer is built: the command line needs ``OPTIMIZERS`` for its
parser, and ``--help`` must not wait for torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZERS = ("sgd", "adamw")


def param_groups(
    params: Iterable[nn.Parameter],
    weight_decay: float,
    lr: float | None = None,
    lr_scale: Mapping[int, float] | None = None,
    norm_weight_decay: float = 0.0,
) -> list[dict]:
    """The weights' group and the normalization and bias group (decayed by ``norm_weight_decay``);
    with ``lr_scale`` (by ``id`` of parameter, 1 where absent) one pair per scale, each with its
    ``lr``, scale 1 first."""
    groups: dict[tuple[float, bool], list] = {}
    for p in params:
        scale = 1.0 if lr_scale is None else lr_scale.get(id(p), 1.0)
        groups.setdefault((scale, p.ndim > 1), [])
        groups[(scale, p.ndim > 1)].append(p)
    scales = sorted({scale for scale, _ in groups}, key=lambda s: (s != 1.0, -s)) or [1.0]
    out = []
    for scale in scales:
        for decays in (True, False):
            decay = weight_decay if decays else norm_weight_decay
            group = {"params": groups.get((scale, decays), []), "weight_decay": decay}
            if lr_scale is not None and lr is not None:
                group["lr"] = lr * scale
            out.append(group)
    return out


def build_optimizer(
    params: Iterable[nn.Parameter],
    name: str,
    lr: float,
    momentum: float,
    weight_decay: float,
    lr_scale: Mapping[int, float] | None = None,
    norm_weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW, over ``params`` grouped by ``param_groups``."""
    import torch

    groups = param_groups(params, weight_decay, lr, lr_scale, norm_weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
