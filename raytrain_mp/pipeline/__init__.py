"""Pipelined model parallelism: a model cut into stages, one Ray actor each, run by a schedule.

Pure pieces (no Ray): ``blocks`` (model -> named blocks), ``partition`` (blocks -> stages),
``schedule`` (GPipe, 1F1B), ``microbatch`` (batch -> micro-batches), ``deferred_bn``. Ray pieces:
``stage`` (one stage's actor body), ``trainer`` (``PipelineTrainer``, the driver) and ``run`` (the
``raytrain-mp pipeline`` training run over epochs); ``config`` holds its ``PipelineConfig``.

May import: the shared layer (``raytrain_mp.config``, ``checkpointing``, ``cluster``, ``errors``,
``lr_schedule``, ``models``, ``optim``) and ``raytrain_mp.data``; no other capability.
"""

from raytrain_mp.pipeline.blocks import Block, StageModule, block_parameter_counts, flatten_model
from raytrain_mp.pipeline.deferred_bn import DeferredBatchNorm, commit_deferred_batchnorm, convert_deferred_batchnorm
from raytrain_mp.pipeline.microbatch import MicroBatch, check_microbatches, split_batch
from raytrain_mp.pipeline.partition import (
    BALANCE_MODES,
    StagePlan,
    balance_bounds,
    plan_stages,
    profile_blocks,
    split_bounds,
)
from raytrain_mp.pipeline.schedule import SCHEDULES, build_schedule, clock_ticks, gpipe, one_f_one_b
from raytrain_mp.optim import OPTIMIZERS
from raytrain_mp.pipeline.trainer import PLACEMENT_STRATEGIES, TRANSPORTS, PipelineTrainer, StageFailedError

__all__ = [
    "BALANCE_MODES",
    "OPTIMIZERS",
    "PLACEMENT_STRATEGIES",
    "SCHEDULES",
    "TRANSPORTS",
    "Block",
    "DeferredBatchNorm",
    "MicroBatch",
    "PipelineTrainer",
    "StageFailedError",
    "StageModule",
    "StagePlan",
    "balance_bounds",
    "block_parameter_counts",
    "build_schedule",
    "check_microbatches",
    "clock_ticks",
    "commit_deferred_batchnorm",
    "convert_deferred_batchnorm",
    "flatten_model",
    "gpipe",
    "one_f_one_b",
    "plan_stages",
    "profile_blocks",
    "split_batch",
    "split_bounds",
]
