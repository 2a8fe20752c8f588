"""raytrain_mp: Ray-orchestrated distributed training of PyTorch vision models.

Layout, imports pointing down only (``tests/test_layout.py`` walks them):

- the command line, the Python entry points and this facade: ``cli``, ``api``, ``__init__``;
- the capabilities, one package each: ``ddp`` (DDP on Ray Train), ``pipeline`` (pipelined model
  parallelism on stage actors), ``tune`` (learning-rate sweeps, builds on ``ddp``), ``bench``
  (benchmarks against their bare peers, builds on ``ddp`` and ``pipeline``);
- the shared layer they all use: ``config`` (option machinery and the common training options),
  ``checkpointing``, ``lr_schedule``, ``models``, ``optim``, ``cluster``, ``storage``, ``errors``, and ``data``
  (the Parquet data sets every trainer reads).

Public names (docs/python.md), imported on first use so that ``import raytrain_mp`` pulls in
neither torch nor Ray: the commands' configs ``DDPConfig`` and ``PipelineConfig``, ``fit`` (what a
command runs) and ``build_trainer`` (``api``), ``tune_trainable`` and the Tune callback it needs,
``ReleaseStoppedWorkerGroups`` (``tune.trainable``), and the
pieces ``convert_sync_batchnorm``, ``scaled_lr``, ``PipelineTrainer``.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "DDPConfig": "raytrain_mp.ddp.config",
    "PipelineConfig": "raytrain_mp.pipeline.config",
    "fit": "raytrain_mp.api",
    "build_trainer": "raytrain_mp.api",
    "tune_trainable": "raytrain_mp.tune.trainable",
    "ReleaseStoppedWorkerGroups": "raytrain_mp.tune.trainable",
    "convert_sync_batchnorm": "raytrain_mp.ddp.sync_batchnorm",
    "scaled_lr": "raytrain_mp.lr_schedule",
    "PipelineTrainer": "raytrain_mp.pipeline.trainer",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'raytrain_mp' has no attribute {name!r}")
