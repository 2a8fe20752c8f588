"""Learning-rate scaling with the global batch, and the per-iteration warmup-then-decay schedule.

Pure functions, no torch or Ray. The rules (Goyal et al. 2017, "Accurate, Large Minibatch SGD"):

- ``scaled_lr``: ``linear`` multiplies ``base_lr`` by ``global_batch / base_batch`` (the linear
  scaling rule); ``sqrt`` by its square root (used with Adam-family optimizers); ``none`` keeps it.
- ``LRSchedule``: gradual warmup ramps linearly, per iteration, from ``start_lr`` at step 0 to the
  scaled lr at step ``warmup_steps``; then cosine decay to 0 at ``total_steps`` or step decay
  (times ``gamma`` every ``step_epochs`` epochs), or constant. Invariants: ``lr(0) == start_lr`` when
  there is a warmup, ``lr(warmup_steps) == peak``, never negative, continuous at the warmup's end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

RULES = ("linear", "sqrt", "none")
DECAYS = ("cosine", "step", "none")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int = 256, rule: str = "linear") -> float:
    """The learning rate for ``global_batch`` given ``base_lr`` tuned at ``base_batch``."""
    if not base_lr > 0 or not math.isfinite(base_lr):
        raise ValueError(f"base_lr must be a finite number > 0, got {base_lr}")
    if int(global_batch) != global_batch or global_batch < 1:
        raise ValueError(f"global_batch must be an integer >= 1, got {global_batch}")
    if int(base_batch) != base_batch or base_batch < 1:
        raise ValueError(f"base_batch must be an integer >= 1, got {base_batch}")
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the optimizer step (0-based)."""

    start_lr: float
    peak_lr: float
    warmup_steps: int
    total_steps: int
    decay: str = "cosine"
    steps_per_epoch: int = 1
    step_epochs: int = 30
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if self.total_steps < 1 or self.steps_per_epoch < 1:
            raise ValueError("total_steps and steps_per_epoch must be >= 1")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"warmup_steps must be in [0, total_steps], got {self.warmup_steps}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start_lr + (self.peak_lr - self.start_lr) * step / self.warmup_steps
        if self.decay == "cosine":
            span = self.total_steps - self.warmup_steps
            progress = min(1.0, (step - self.warmup_steps) / span) if span else 1.0
            return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            return self.peak_lr * self.gamma ** ((step // self.steps_per_epoch) // self.step_epochs)
        return self.peak_lr

    def factor(self, step: int) -> float:
        """``lr(step) / peak_lr``: the multiplier torch's ``LambdaLR`` expects."""
        return self(step) / self.peak_lr


def make_schedule(
    base_lr: float,
    global_batch: int,
    base_batch: int,
    rule: str,
    warmup_epochs: float,
    epochs: int,
    steps_per_epoch: int,
    decay: str = "cosine",
    step_epochs: int = 30,
    gamma: float = 0.1,
) -> LRSchedule:
    """The schedule of a run: peak = ``scaled_lr``, warmup over ``warmup_epochs`` (rounded to steps)."""
    total = epochs * steps_per_epoch
    warmup = min(total, int(round(warmup_epochs * steps_per_epoch)))
    peak = scaled_lr(base_lr, global_batch, base_batch, rule)
    # Warmup ramps up from base_lr (Goyal et al.); below base_batch the peak is smaller and there is nothing to ramp.
    start = min(base_lr, peak)
    return LRSchedule(start, peak, warmup, total, decay, steps_per_epoch, step_epochs, gamma)


def schedule_for(cfg: Any, steps_per_epoch: int) -> LRSchedule:
    """``make_schedule`` of a training command's config (``config.TrainOptions``' lr options and
    its ``global_batch_size``) at ``steps_per_epoch`` optimizer steps an epoch."""
    return make_schedule(
        cfg.base_lr,
        cfg.global_batch_size,
        cfg.base_batch,
        cfg.lr_rule,
        cfg.warmup_epochs,
        cfg.epochs,
        steps_per_epoch,
        cfg.lr_decay,
        cfg.step_epochs,
        cfg.gamma,
    )
