"""Build the vision models the trainers train: torchvision ResNets, never anything Ray-aware.

Invariants:
- The model is a plain ``torchvision.models.ResNet``; its state dict is the one a user gets from
  ``build_model`` (or from torchvision plus the small-stem edit below), so a checkpoint's
  ``model.pt`` loads into it with ``strict=True``.
- The small-input stem (3x3 stride-1 conv, no max-pool) replaces ``conv1`` and ``maxpool`` in
  place, so parameter names stay torchvision's.
- Nothing is downloaded: weights are random (seeded by the caller) or read from ``weights``.
- torch and torchvision are imported when a model is built, not with the module: the command
  line needs ``MODEL_NAMES`` to build its parser, and ``--help`` must not wait for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from raytrain_mp.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

MODEL_NAMES = ("resnet18", "resnet34", "resnet50")


def wants_small_stem(image_size: int) -> bool:
    """The 7x7/2 conv and the max-pool shrink a 32x32 image to 8x8 before layer1; below 64 px
    that throws most of the image away, so small images get the CIFAR-style stem."""
    return image_size < 64


def build_model(
    name: str,
    num_classes: int,
    in_channels: int = 3,
    small_stem: bool = False,
    weights: str | Path | None = None,
) -> nn.Module:
    """A torchvision ResNet with ``num_classes`` outputs and ``in_channels`` input channels."""
    from torch import nn
    from torchvision import models as tv_models

    if name not in MODEL_NAMES:
        raise UsageError(f"--model: unknown model {name!r}; accepted: {', '.join(MODEL_NAMES)}")
    if num_classes < 2:
        raise UsageError(f"num_classes must be >= 2, got {num_classes}")
    model = getattr(tv_models, name)(weights=None, num_classes=num_classes)
    if small_stem:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if weights is not None:
        load_weights(model, weights)
    return model


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a plain state dict (as written to ``model.pt``) with ``strict=True``."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--weights: no such file {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a bad file
        raise UsageError(f"--weights: {path} is not a torch state dict ({type(exc).__name__})") from exc
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[1:2] or [str(exc)]
        raise UsageError(f"--weights: {path} does not fit the model: {first[0].strip()}") from exc
