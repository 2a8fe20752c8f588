"""Weight EMA (``--model-ema``): an exponential moving average of the model, kept beside it,
evaluated every epoch and saved in every checkpoint, as torchvision's reference ``train.py`` keeps it.

The average itself is torch's ``AveragedModel`` with ``get_ema_multi_avg_fn`` over parameters and
buffers (``use_buffers``: the BatchNorm statistics are averaged too), so this module owns only
*when* it is updated and *how much*, both taken from the reference:

- **when**: after the optimizer step of every batch whose index within its epoch is a multiple of
  ``--model-ema-steps``; during the warmup epochs the count of averages is reset after each update,
  so the average restarts from a copy of the model until warmup ends;
- **how much**: the decay adjusted for the update interval, ``alpha = (1 - decay) * B *
  ema_steps / epochs`` (``B`` the global batch; the reference's ``world_size * batch_size``),
  capped at 1, and the decay used is ``1 - alpha``.

Invariants: both depend on the global step, the global batch and the options only, never on the
number of workers; every rank holds the same model, so every rank's average is the same, and rank
0's is the one saved. A checkpoint holds the average (``ema.pt``, a plain state dict like
``model.pt``) and its count of averages (``train_state.pt``), so a resume continues it exactly.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def adjusted_decay(decay: float, ema_steps: int, global_batch_size: int, epochs: int) -> float:
    """The decay applied per update: the reference's adjustment of ``--model-ema-decay`` for an
    update every ``ema_steps`` steps of ``global_batch_size`` samples over ``epochs`` epochs."""
    alpha = min(1.0, (1.0 - decay) * global_batch_size * ema_steps / epochs)
    return 1.0 - alpha


class ModelEMA:
    """The average of ``model`` (a copy of it, on its device) and when to update it."""

    def __init__(self, model: nn.Module, decay: float, every: int, warmup_epochs: float) -> None:
        self.every, self.warmup_epochs = every, warmup_epochs
        self.decay = decay
        self.average = AveragedModel(copy.deepcopy(model), multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.average.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        """The averaged model, to evaluate or save."""
        return self.average.module

    def after_step(self, model: nn.Module, epoch: int, index_in_epoch: int) -> None:
        """Update after the optimizer step of batch ``index_in_epoch`` of ``epoch`` (both from 0)."""
        if index_in_epoch % self.every:
            return
        self.average.update_parameters(model)
        if epoch < self.warmup_epochs:
            self.average.n_averaged.fill_(0)

    @property
    def averaged(self) -> int:
        """Updates since the average last restarted (0: it is the model's copy at its next update)."""
        return int(self.average.n_averaged)

    def load(self, state: dict[str, torch.Tensor], averaged: int) -> None:
        """Continue from a checkpoint's ``ema.pt`` and its count of averages."""
        self.module.load_state_dict(state, strict=True)
        self.average.n_averaged.fill_(averaged)
