"""Timing a sweep of (schedule, m) points on running stages: the code every case of ours goes
through (the ResNet layouts, the overhead MLP, the hybrid layouts).

Job: per (schedule, m) of a ``Sweep``, switch the running ``PipelineTrainer`` to it, time
``warmup`` + ``steps`` steps one Ray call at a time, then the same steps queued as the run loop
trains them (``steps_per_call`` steps a call, the next call queued behind the running one,
``queued_step_seconds``), and record each stage's busy time and the bubble.

Invariants:
- A layout's stages start once and the sweep changes only the schedule and m
  (``PipelineTrainer.set_schedule``), so actor start-up and profiling are never timed. A
  (schedule, m) that ``set_schedule`` refuses is listed under ``skipped`` with its reason. The
  ResNet and the MLP go through the same timing code (``sweep_runs``, and
  ``bench.pipeline_native.measure`` on the native side).
- The measured bubble fraction (``PipelineTrainer.stats``) sits next to the schedule's ideal
  bubble (``schedule.ideal_bubble``) and, for GPipe and 1F1B, the bubble a perfect runtime would
  show with the measured stage times (``schedule.bubble_for_stage_times``, for GPipe with each
  stage's forward and backward apart: the stages are rarely equal on a CPU, where per-sample cost
  depends on the micro-batch size).
- Each figure keeps its timed steps under ``samples``, so that rounds can be pooled
  (``bench.common.pooled``).
"""

from __future__ import annotations

import time
from typing import Any

from torch import Tensor

from raytrain_mp.bench.common import summarize, timed
from raytrain_mp.bench.pipeline.shared import Sweep, progress
from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline import PipelineTrainer
from raytrain_mp.pipeline.schedule import SCHEDULES, ideal_bubble, stage_times_bubble


def queued_steps(trainer: PipelineTrainer, x: Tensor, y: Tensor, sweep: Sweep) -> tuple[list[float], list[float]]:
    """The steps as the run loop trains them (``PipelineTrainer.train_steps``): ``sweep.steps_per_call``
    steps a Ray call, the next call queued behind the running one. Per call, the seconds per step
    from one call's end to the next's (the throughput of a training run) and the bubble fraction
    over that time. Calls holding the first ``sweep.warmup`` steps (at least one call, so that
    every interval starts at a call's end) are not counted; ``sweep.steps`` rounds up to whole calls."""
    per_call = sweep.steps_per_call
    warmup = max(1, -(-sweep.warmup // per_call))
    calls = warmup + -(-sweep.steps // per_call)
    ends, bubbles = [], []
    for i, _ in enumerate(
        trainer.train_steps(((x, y, None) for _ in range(calls * per_call)), steps_per_call=per_call)
    ):
        if i % per_call == 0:  # a call's steps arrive together: its first marks its end
            ends.append(time.perf_counter())
        if i % per_call == per_call - 1:
            bubbles.append(trainer.stats(reset=True).bubble_fraction)
    seconds = [(later - earlier) / per_call for earlier, later in zip(ends[warmup - 1 :], ends[warmup:])]
    return seconds, bubbles[warmup:]


def pipeline_run(trainer: PipelineTrainer, x: Tensor, y: Tensor, schedule: str, m: int, sweep: Sweep) -> dict[str, Any]:
    """Step time, busy time per stage and bubble fraction of one (schedule, m) on running stages
    (``trainer.set_schedule`` already called); the ideal bubble of the schedules that have a formula."""
    trainer.stats(reset=True)
    per_step: list[dict[str, Any]] = []

    def step() -> None:
        trainer.train_step(x, y)
        per_step.append(trainer.stats(reset=True))

    seconds = timed(step, sweep.warmup, sweep.steps)
    progress(f"{sweep.label}{schedule} m={m}", summarize(seconds), sweep.unit)
    measured = per_step[sweep.warmup :]
    queued, queued_bubbles = queued_steps(trainer, x, y, sweep)
    progress(
        f"{sweep.label}{schedule} m={m}, {sweep.steps_per_call} step(s) a call, queued", summarize(queued), sweep.unit
    )
    busy = [summarize(per_stage) for per_stage in zip(*(s.busy_seconds for s in measured))]
    forward_busy = [summarize(per_stage) for per_stage in zip(*(s.forward_busy_seconds for s in measured))]
    samples = {
        "step_seconds": seconds,
        "queued_step_seconds": queued,
        "bubble_fraction": [s.bubble_fraction for s in measured],
        "queued_bubble_fraction": queued_bubbles,
        "rank_step_seconds": [s.rank_seconds_per_step for s in measured],
    }
    run = {
        "schedule": schedule,
        "microbatches": m,
        **{figure: summarize(values) for figure, values in samples.items()},
        "busy_seconds": busy,
        "forward_busy_seconds": forward_busy,
        "samples": samples,
        "memory_formats": trainer.memory_formats,  # per actor, the layout of each of its stages
    }
    # With replicas, busy has one entry per actor; the formulas are about one pipeline (replica 0's).
    if SCHEDULES[schedule].bubble is not None:  # a closed-form ideal bubble
        run["bubble_formula"] = ideal_bubble(schedule, trainer.num_stages, m, trainer.virtual_stages)
    # GPipe's phases count apart (each pays its own slowest stage); 1F1B alternates them.
    stage_busy, stage_forward = ([s["median"] for s in figure[: trainer.num_stages]] for figure in (busy, forward_busy))
    predicted = stage_times_bubble(schedule, stage_busy, m, stage_forward)
    if predicted is not None:
        run["bubble_for_stage_times"] = predicted
    return run


def sweep_runs(
    trainer: PipelineTrainer, x: Tensor, y: Tensor, sweep: Sweep
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, skipped): every (schedule, m) of ``sweep`` on the trainer's running stages, but those
    the schedule refuses (1F1B with m < stages), listed with the reason."""
    runs, skipped = [], []
    for schedule in sweep.schedules:
        for m in sweep.microbatches:
            try:
                trainer.set_schedule(schedule, m)
            except UsageError as exc:
                skipped.append({"schedule": schedule, "microbatches": m, "reason": str(exc)})
                print(f"{sweep.label}{schedule} m={m}: skipped, {exc}", flush=True)
                continue
            runs.append(pipeline_run(trainer, x, y, schedule, m, sweep))
    return runs, skipped
