"""Fine-tuning a pretrained backbone: head-only training, and a lower learning rate for the backbone.

The backbone is every parameter outside the classifier head (``pretrained.head_path``: ``fc`` of a
ResNet). Two switches of ``ddp`` and ``tune``:

- ``--freeze-backbone`` (``freeze_backbone``): the backbone's parameters stop requiring gradients
  (the optimizers skip a parameter without a gradient, weight decay and momentum included, so each
  stays bit-identical), and each BatchNorm of the backbone stays in eval mode whatever ``train()``
  says, through a forward pre-hook: it normalizes with, and never updates, its pretrained running
  statistics. Nothing is renamed or wrapped, so the state dict keeps torchvision's keys and the
  checkpoint's ``model.pt`` loads strict into the plain model. Applied after any BatchNorm
  conversion (``convert_sync_batchnorm`` makes new layers, which would drop the hook).
- ``--backbone-lr-scale S`` (``lr_scales``): the backbone's learning rate is S times the head's,
  in every step of the schedule (``optim.build_optimizer`` puts the scale into each parameter
  group's lr, which ``LambdaLR`` multiplies by the schedule's factor).

Invariant: both are functions of the model's module paths only, so every rank (and a restarted
run) freezes and scales the same parameters; nothing here draws random numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from raytrain_mp.pretrained import head_path


def _stay_in_eval(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a frozen BatchNorm: normalize with the running statistics, update none."""
    module.training = False


def in_head(name: str, head: str) -> bool:
    return name == head or name.startswith(head + ".")


def freeze_backbone(model: nn.Module) -> int:
    """Freeze every parameter and BatchNorm outside the head of ``model`` (a plain model, or one whose
    BatchNorm layers were converted); returns how many parameters were frozen."""
    head = head_path(model)
    frozen = 0
    for name, parameter in model.named_parameters():
        if not in_head(name, head):
            parameter.requires_grad_(False)
            frozen += 1
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not in_head(name, head):
            module.register_forward_pre_hook(_stay_in_eval)
            module.training = False
    return frozen


def lr_scales(model: nn.Module, backbone_scale: float) -> dict[int, float]:
    """The learning-rate scale of each parameter of ``model`` by ``id``: 1 in the head,
    ``backbone_scale`` elsewhere (``optim.build_optimizer``'s ``lr_scale``)."""
    head = head_path(model)
    return {id(p): 1.0 if in_head(name, head) else backbone_scale for name, p in model.named_parameters()}


def backbone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every tensor of the state dict outside the head: what freezing keeps bit-identical."""
    head = head_path(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not in_head(k.rpartition(".")[0], head)}
