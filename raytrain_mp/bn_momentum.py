"""BatchNorm momentum: ``--bn-momentum`` sets it on every BatchNorm layer of a model, and
``convergence_note`` says when a model's running statistics cannot have converged.

In training mode a BatchNorm layer normalizes with the batch's statistics; in eval mode (validation,
``eval``, ``predict``, an exported model) with its running statistics, which every training step
moves by ``momentum`` towards the batch's: after ``n`` steps the initial values (mean 0, variance 1)
still weigh ``(1 - momentum) ** n``. A model whose layers keep a small momentum (torchvision's
MobileNetV3, EfficientNet-B5 to B7 and MaxViT use 0.01, MNASNet 0.0003; the others 0.1) and trains
for a few steps keeps mostly its initial statistics, and scores chance in eval mode while the same
weights score well with batch statistics.

Invariants: pure functions of the model (and the step count); nothing here knows of Ray or of a
trainer. A layer without running statistics, or with ``momentum=None`` (a cumulative average,
converged by construction), is never reported. The note is one line starting ``note:``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

# The weight of the initial statistics above which the running ones cannot describe the data: a
# quarter is past noise (the eval-mode outputs of such a layer are visibly off) and, at the usual
# momentum 0.1, means fewer than 14 steps.
STALE_WEIGHT = 0.25
# The weight aimed at by the note's advice: 5% left of the initial statistics.
TARGET_WEIGHT = 0.05


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """Every BatchNorm layer of ``model`` (1d, 2d, 3d, SyncBatchNorm and subclasses) that keeps running statistics."""
    return [
        module
        for module in model.modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
    ]


def set_bn_momentum(model: nn.Module, momentum: float) -> int:
    """Set every BatchNorm layer's momentum (as timm's ``--bn-momentum``); the number of layers set."""
    layers = batchnorm_layers(model)
    for layer in layers:
        layer.momentum = momentum
    return len(layers)


@dataclass(frozen=True)
class Stale:
    """The layers whose running statistics still weigh their initial values more than ``STALE_WEIGHT``."""

    layers: int  # how many
    momentum: float  # the smallest momentum among them
    weight: float  # the largest weight of initial statistics left among them
    steps: int


def stale_statistics(model: nn.Module, steps: int, threshold: float = STALE_WEIGHT) -> Stale | None:
    """The layers of ``model`` whose running statistics cannot have converged after ``steps``
    training steps (``(1 - momentum) ** steps > threshold``), or None."""
    momenta = [layer.momentum for layer in batchnorm_layers(model) if layer.momentum is not None]
    stale = [m for m in momenta if (1 - m) ** max(steps, 0) > threshold]
    if not stale:
        return None
    smallest = min(stale)
    return Stale(len(stale), smallest, (1 - smallest) ** max(steps, 0), steps)


def steps_needed(momentum: float, weight: float = TARGET_WEIGHT) -> int | None:
    """Steps after which the initial statistics weigh at most ``weight`` at this ``momentum``
    (None: never, at momentum 0)."""
    if momentum <= 0:
        return None
    if momentum >= 1:
        return 1
    return math.ceil(math.log(weight) / math.log(1 - momentum))


def momentum_needed(steps: int, weight: float = TARGET_WEIGHT) -> float:
    """The smallest momentum (rounded up to 2 decimals) that leaves at most ``weight`` after ``steps``."""
    return min(1.0, math.ceil((1 - weight ** (1 / max(steps, 1))) * 100) / 100)


def convergence_note(model: nn.Module, steps: int, threshold: float = STALE_WEIGHT) -> str | None:
    """One ``note:`` line when some BatchNorm running statistics of ``model`` cannot have converged
    after ``steps`` steps: how many layers, their momentum, and what to do; else None."""
    stale = stale_statistics(model, steps, threshold)
    if stale is None:
        return None
    layers = f"{stale.layers} BatchNorm layer{'s' * (stale.layers != 1)}"
    momentum = f"{stale.momentum:g}"
    needed = steps_needed(stale.momentum)
    longer = f"train for about {needed} steps, or " if needed else ""
    return (
        f"note: {layers} with momentum {momentum} still hold {stale.weight:.0%} of their initial running statistics "
        f"after {steps} steps, so evaluation, which uses them, is not yet meaningful: {longer}set --bn-momentum "
        f"{momentum_needed(steps):g}"
    )
