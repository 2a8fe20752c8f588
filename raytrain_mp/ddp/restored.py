"""The checkpoint a DDP run continues from, read before the model is built (``loop.restore`` loads
it): its memory format decides how the restarted group computes (``execution``).

Invariant: Ray Train's checkpoint (a restarted worker group, an elastic resize, a rerun of the
same ``--name``) wins over ``--resume-from``; a fresh start reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray.train

from raytrain_mp.checkpointing import load_checkpoint, load_ema, read_checkpoint, read_ema
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.storage import join, locate, name_of


@dataclass
class Restored:
    """The checkpoint a run continues from, read: where it is and what it holds."""

    folder: str
    model_state: dict
    train_state: dict
    ema_state: dict | None


def read_restored(cfg: DDPConfig) -> Restored | None:
    """The checkpoint the run continues from: Ray's (a restarted worker group, a rerun of the same
    name) wins over --resume-from; None on a fresh start."""
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            model_state, train_state = read_checkpoint(d)
            ema_state = read_ema(d)
        folder = join(cfg.storage_path, cfg.name, name_of(restored.path))  # Ray's path lacks a URI's scheme
        return Restored(folder, model_state, train_state, ema_state)
    if cfg.resume_from:
        folder = locate(cfg.resume_from, "--resume-from")
        (model_state, train_state), ema_state = load_checkpoint(folder), load_ema(folder)
        return Restored(cfg.resume_from, model_state, train_state, ema_state)
    return None
