"""Pipelined model parallelism: a model cut into stages, one Ray actor each, run by a schedule.

A stage computes in a layout of the shared ``memory_format``, compiled by the shared ``compilation``
under ``--compile``.

Pure pieces (no Ray): ``block`` (what a block is), ``blocks`` (model -> named blocks; ``traced`` for a
model cut from its torch.fx graph), ``partition`` (blocks -> stages), ``schedule`` (the schedule
registry: each one's torch class, limits, ideal bubble, stage layout), ``microbatch`` (batch ->
micro-batches), ``deferred_bn``, ``replicas`` (data x pipeline: rank layout, batch shares, replica
placement, BatchNorm merge weights), ``handoff`` (a batch to a stage actor, zero-copy), ``layouts``
(placement strategy names), ``busy_clock`` (the seconds a rank computes, timed on its device). Ray pieces:
``feed`` (a replica's batches read on its first and last stage: ``StageData``), ``stage`` (one rank's
actor body, running torch.distributed.pipelining's schedules) with ``stage_config`` (what a rank is
given, its device), ``timed_stage`` (torch's stage, timed, receives posted ahead, last backward split)
and ``shaped_p2p`` (eval tensors between ranks), ``replica_sync`` (what a stage's replicas all-reduce
after each step), ``teardown`` (stopping actors: returns once they are dead), ``blame`` (which rank a
failed call names, from Ray's errors: a rule without a running Ray). The driver: ``spec`` (``PipelineSpec``:
every option, validated once), ``placement`` (joining Ray, bundles, resource check, placement groups),
``actors`` (the stage actors: start, call, gather, stop), ``failures`` (``StageFailedError``, waiting
for the origin), ``trials`` (time balance: profile, cut, balance trials), ``submission`` (the queue
of step calls), ``stats`` (``StepStats``), ``trainer`` (``PipelineTrainer``, over those) and ``run``
(the ``raytrain-mp pipeline`` training run over epochs); ``config`` holds its ``PipelineConfig``.

May import: the shared layer (``raytrain_mp.config``, ``checkpointing``, ``cluster``, ``storage``, ``errors``,
``lr_schedule``, ``models``, ``optim``) and ``raytrain_mp.data``; no other capability.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that ``pipeline.config`` and the pure modules load without Ray.
_EXPORTS = {
    "Block": "block",
    **dict.fromkeys(("StageModule", "block_parameter_counts", "flatten_model"), "blocks"),
    **dict.fromkeys(("DeferredBatchNorm", "commit_deferred_batchnorm", "convert_deferred_batchnorm"), "deferred_bn"),
    **dict.fromkeys(("MicroBatch", "check_microbatches", "split_batch"), "microbatch"),
    **dict.fromkeys(
        (
            "BALANCE_MODES",
            "StagePlan",
            "balance_bounds",
            "balance_fill_drain_bounds",
            "plan_stages",
            "profile_blocks",
            "split_bounds",
        ),
        "partition",
    ),
    **dict.fromkeys(
        (
            "SCHEDULES",
            "Schedule",
            "build_schedule",
            "check_schedule",
            "clock_ticks",
            "gpipe",
            "ideal_bubble",
            "one_f_one_b",
            "stage_indices",
        ),
        "schedule",
    ),
    "PLACEMENT_STRATEGIES": "placement",
    "PipelineSpec": "spec",
    "PipelineTrainer": "trainer",
    "StageFailedError": "failures",
    "BalanceTrial": "trials",
    "StepStats": "stats",
    "StageData": "feed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
