"""What both training loops (``ddp.loop``, ``pipeline.run``) decide around their epochs, once.

The run's model in the run's dtype (from ``--precision``, with ``--bn-momentum`` applied) with its
pretrained weights resolved and ``--compile`` probed on the driver (``with_checked_model``), when a
checkpoint is due, the line each epoch ends with, and the note a run ends with when its BatchNorm
running statistics cannot have converged (``bn_momentum``). Functions of a training command's
config, the data set and the position in the run (no Ray, no files but the weights' cache):

- Positions count from 0 for epochs and in steps done: "after ``steps_done`` steps of epoch
  ``epoch``" is global step ``epoch * steps_per_epoch + steps_done``; an epoch's end is
  ``steps_done == steps_per_epoch``.
- A checkpoint follows every global step ``--checkpoint-every-steps`` divides (within an epoch
  too), and the end of every ``--checkpoint-every``-th epoch and of the last one; so both loops
  write the same checkpoints, named by ``checkpointing.checkpoint_name``.
- The epoch line starts with the same fields in both loops; a loop adds its own (the pipeline's
  bubble) before the learning rate, which ends it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from raytrain_mp.bn_momentum import convergence_note, set_bn_momentum
from raytrain_mp.compilation import check_compiler
from raytrain_mp.models import build_model, check_model
from raytrain_mp.preprocessing import input_size
from raytrain_mp.pretrained import resolve
from raytrain_mp.readable import number
from raytrain_mp.views import Views


def run_dtype(precision: str) -> torch.dtype:
    """The dtype the model's parameters and inputs have: float64 for ``fp64`` (verification), else
    float32 (``bf16`` and ``fp16`` autocast around float32 parameters)."""
    return torch.float64 if precision == "fp64" else torch.float32


def run_input_size(cfg: Any, meta: Any) -> int:
    """The side of the run's model input in training: the data set's image size or the run's
    training view (``views``), or the crop of pretrained weights' preprocessing
    (``preprocessing.input_size``)."""
    return input_size(cfg.preprocess, Views.of(meta, cfg).training_size(cfg.augment))


def build_run_model(cfg: Any, meta: Any) -> nn.Module:
    """The run's model for the data set ``meta`` describes, in the run's dtype (``models`` adapts
    it to the data: channels, small stem, the input size; ``--weights`` a file the driver resolved,
    its head and stem fitted by ``pretrained``); the caller seeds it (a new head's init)."""
    model = build_model(
        cfg.model, meta.num_classes, meta.channels, cfg.small_stem, cfg.weights, image_size=run_input_size(cfg, meta)
    )
    if getattr(cfg, "bn_momentum", None) is not None:
        set_bn_momentum(model, cfg.bn_momentum)
    return model.to(run_dtype(cfg.precision))


def with_checked_model(cfg: Any, meta: Any) -> Any:
    """``cfg`` with ``--weights`` resolved to a local state dict file and ``--preprocess`` to the run's
    spec (``pretrained.resolve``: a torchvision name fetched into its cache, its preprocessing the
    default), and the model built and probed on the input it will get (``models.check_model``).
    For the driver, before Ray starts: the weights' lines (and the head's and stem's) print here
    once, unless ``--quiet``."""
    say = None if cfg.quiet else print
    weights, preprocess = resolve(cfg.model, cfg.weights, cfg.preprocess, say)
    cfg = dataclasses.replace(cfg, weights=weights, preprocess=preprocess)
    size = run_input_size(cfg, meta)
    check_model(cfg.model, meta.num_classes, meta.channels, size, cfg.small_stem, cfg.weights, say=say)
    check_compiler(cfg)  # --compile: can this machine compile at all
    return cfg


def running_stats_note(options: Any, meta: Any, steps: int) -> str | None:
    """``bn_momentum.convergence_note`` of a run's model (``options``: its config or config.yaml's
    mapping: ``model``, ``small_stem``, ``bn_momentum``) after ``steps`` training steps. The model
    is built on the meta device where it can be: only its layers' momenta are read."""
    get = options.get if isinstance(options, dict) else lambda key: getattr(options, key, None)
    args = (get("model"), meta.num_classes, meta.channels, get("small_stem"))
    try:
        with torch.device("meta"):
            model = build_model(*args, image_size=meta.image_size)
    except Exception:  # noqa: BLE001 (some initializers refuse meta tensors, e.g. RegNet's: build it for real)
        with torch.random.fork_rng(devices=[]):
            model = build_model(*args, image_size=meta.image_size)
    if get("bn_momentum") is not None:
        set_bn_momentum(model, get("bn_momentum"))
    return convergence_note(model, steps)


def due_by_steps(global_step: int, every_steps: int | None) -> bool:
    """Whether ``--checkpoint-every-steps`` (None or 0: off) asks for a checkpoint after ``global_step`` steps."""
    return bool(every_steps) and global_step % every_steps == 0


def checkpoint_due(cfg: Any, epoch: int, steps_done: int, steps_per_epoch: int) -> bool:
    """Whether a checkpoint follows ``steps_done`` steps of epoch ``epoch``: within the epoch by
    ``due_by_steps``, at its end also every ``checkpoint_every`` epochs and after the last.
    ``cfg``: a training command's config (``epochs``, ``checkpoint_every``, ``checkpoint_every_steps``)."""
    by_steps = due_by_steps(epoch * steps_per_epoch + steps_done, cfg.checkpoint_every_steps)
    if steps_done < steps_per_epoch:
        return by_steps
    return by_steps or (epoch + 1) % cfg.checkpoint_every == 0 or epoch + 1 == cfg.epochs


def epoch_line(metrics: dict, epochs: int, extra: str = "") -> str:
    """``epoch E/N train_loss .. val_loss .. val_accuracy .. [val_accuracy_ema ..] samples/s ..{extra} lr ..``
    of an epoch's metrics."""
    ema = f" val_accuracy_ema {number(metrics['val_accuracy_ema'])}" if "val_accuracy_ema" in metrics else ""
    return (
        f"epoch {metrics['epoch']}/{epochs} train_loss {number(metrics['train_loss'])} "
        f"val_loss {number(metrics['val_loss'])} val_accuracy {number(metrics['val_accuracy'])}{ema} "
        f"samples/s {metrics['samples_per_second']:.1f}{extra} lr {number(metrics['lr'])}"
    )
