"""raytrain_mp: Ray-orchestrated distributed training of PyTorch vision models.

Public names: ``convert_sync_batchnorm``, ``scaled_lr``, ``PipelineTrainer`` (imported lazily so
``import raytrain_mp`` does not pull in Ray).
"""

from __future__ import annotations

from raytrain_mp.lr_schedule import scaled_lr
from raytrain_mp.sync_batchnorm import convert_sync_batchnorm

__all__ = ["PipelineTrainer", "convert_sync_batchnorm", "scaled_lr"]


def __getattr__(name: str):
    if name == "PipelineTrainer":
        from raytrain_mp.pipeline import PipelineTrainer

        return PipelineTrainer
    raise AttributeError(f"module 'raytrain_mp' has no attribute {name!r}")
