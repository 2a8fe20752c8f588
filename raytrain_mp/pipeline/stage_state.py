"""A pipeline rank's state: its stages' weights, optimizer and weight average, in and out.

Job: the state half of ``stage.StageWorker`` (a mixin: it needs the worker's ``modules``,
``optimizer`` and ``config``): the learning rate, the stages' state dicts and optimizer state,
and ``--model-ema``'s average of each stage (``ema.ModelEMA``), updated after each step the rank
trains at a data-set position, as DDP's loop updates its one.

Invariants:
- State dicts use the original model's keys and leave the rank as contiguous CPU tensors, the
  average's as the model's (``average=True``), so the driver merges either into one plain state
  dict (``model.pt``, ``ema.pt``).
- Every replica of a stage holds the same model and so the same average; a stage's average is
  updated by the same rule on every rank (the global step's position, ``ModelEMA.after_step``), so
  the ranks' averages together are the whole model's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from raytrain_mp.ema import ModelEMA


class StageState:
    """State methods of a rank (``StageWorker`` mixes them in)."""

    def _build_averages(self) -> None:
        """One ``ModelEMA`` per local stage when the config keeps an average (``ema_decay``)."""
        config = self.config
        self._emas = (
            [ModelEMA(module, config.ema_decay, config.ema_steps, config.ema_warmup_epochs) for module in self.modules]
            if config.ema_decay is not None
            else []
        )

    def _update_averages(self, epoch: int, index_in_epoch: int) -> None:
        for average, module in zip(self._emas, self.modules):
            average.after_step(module, epoch, index_in_epoch)

    @contextmanager
    def _averaged_weights(self, average: bool) -> Iterator[None]:
        """The stages compute with their averages' weights inside (``average``), their own after."""
        if not average:
            yield
            return
        saved = [{key: value.clone() for key, value in module.state_dict().items()} for module in self.modules]
        for module, ema in zip(self.modules, self._emas, strict=True):
            module.load_state_dict(ema.module.state_dict())
        try:
            yield
        finally:
            for module, state in zip(self.modules, saved):
                module.load_state_dict(state)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self, average: bool = False) -> dict[str, Tensor]:
        """The stages' weights (``average``: their averages'); contiguous: a checkpoint holds plain
        tensors whatever layout the rank computes in."""
        modules = [ema.module for ema in self._emas] if average else self.modules
        return {
            key: value.detach().cpu().contiguous() for module in modules for key, value in module.state_dict().items()
        }

    def load_state_dict(self, state: Mapping[str, Tensor], average: bool = False, averaged: int = 0) -> None:
        """Load the stages' weights, or (``average``) their averages' with their count of averages."""
        if average:
            for ema in self._emas:
                ema.load({key: state[key] for key in ema.module.state_dict()}, averaged)
            return
        for module in self.modules:
            module.load_state_dict({key: state[key] for key in module.state_dict()}, strict=True)

    def averaged(self) -> int:
        """Updates since the averages last restarted (the same for every stage)."""
        return self._emas[0].averaged

    def optimizer_state_dict(self) -> dict[str, Any]:
        return _to_cpu(self.optimizer.state_dict())

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        # Optimizer.load_state_dict moves the state onto each parameter's device itself.
        self.optimizer.load_state_dict(state)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {key: _to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(value) for value in obj]
    return obj
