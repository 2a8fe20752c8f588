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


def load_under_own_options(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    optimizer_state: dict,
    scheduler_state: dict,
) -> None:
    """Load a checkpoint's optimizer and schedule state (momentum buffers, the schedule's step)
    under the options the run was built with: each group's lr, weight decay and the optimizer's
    other settings stay the run's, the lr at the restored step of the run's own schedule.

    A restart of the same run gets back exactly what it saved (its options are the checkpoint's, and
    the lr is ``base_lr * factor(step)``, what ``LambdaLR`` computes). A run that continues another
    run's checkpoint under new options trains with its own: a PBT trial exploiting a better trial's
    checkpoint with a perturbed lr or weight decay, ``--resume-from`` with a new ``--base-lr``.
    ``load_state_dict`` alone would keep the checkpoint's, silently."""
    own = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    scheduler.base_lrs = base_lrs
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(base_lrs, scheduler.lr_lambdas)]
    for group, options, lr in zip(optimizer.param_groups, own, lrs):
        group.update(options, lr=lr)
    scheduler._last_lr = lrs  # what get_last_lr() returns after a step; torch keeps it in sync the same way
