"""Ours on one partition of the ResNet (``results["layouts"]``): the layer3 split, time-balanced
stages and interleaved stages.

Job: start a ``PipelineTrainer`` on one partition and run every (schedule, m) of a sweep on it:

- the seeds' fixed split (``--split-points``, default before ``layer3``), GPipe and 1F1B over m=1
  and every m of ``--microbatches`` (``native.layer3_split_rounds`` runs it in rounds); GPipe with
  m=1 on the layer3 split is naive model parallelism (the seeds' ``ModelParallelResNet50``);
- time-balanced stages (``--balanced``), GPipe over ``--microbatches`` only;
- time-balanced ``INTERLEAVED_VIRTUAL`` stages per actor (``--interleaved``), interleaved 1F1B
  over ``--microbatches``.

Invariants:
- The stages start once per layout; only the schedule and m change (``timing.sweep_runs``).
- Peak activation memory per stage is the largest number of micro-batches a stage holds under the
  schedule times the bytes autograd saves for one micro-batch in that stage (measured with
  ``saved_tensors_hooks`` in the driver, parameters excluded), after the timed runs so that it
  never competes with them for CPUs; modelled for the one-stage-per-actor schedules only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline.shared import LR, MOMENTUM, Sweep, stage_modules
from raytrain_mp.bench.pipeline.timing import sweep_runs
from raytrain_mp.pipeline import PipelineTrainer, build_schedule, split_batch
from raytrain_mp.pipeline.run import describe_trial
from raytrain_mp.pipeline.schedule import FORWARD


def max_in_flight(schedule: str, num_stages: int, num_microbatches: int) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not."""
    peaks = []
    for ops in build_schedule(schedule, num_stages, num_microbatches):
        held = peak = 0
        for kind, _ in ops:
            held += 1 if kind == FORWARD else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def saved_activation_bytes(stages: Sequence[nn.Module], x: Tensor, y: Tensor) -> list[int]:
    """Bytes autograd keeps for backward in each stage after one forward of ``x`` (the loss on the
    last stage), counting each storage once and no parameter."""
    params = {p.untyped_storage().data_ptr() for stage in stages for p in stage.parameters()}
    per_stage = []
    h = x
    for index, stage in enumerate(stages):
        saved: dict[int, int] = {}

        def pack(t: Tensor, saved: dict[int, int] = saved) -> Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        inp = h.detach().requires_grad_(index > 0)  # later stages receive a leaf that needs a gradient
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage(inp)
            if index == len(stages) - 1:
                F.cross_entropy(out, y, reduction="sum")
        per_stage.append(sum(saved.values()))
        h = out.detach()
    return per_stage


def layout_runs(
    cfg: BenchPipelineConfig,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    split_points: Sequence[str] | None,
    microbatches: Sequence[int],
    schedules: Sequence[str] = ("gpipe", "1f1b"),
    virtual: int = 1,
) -> dict[str, Any]:
    """Every (schedule, m) of ``schedules`` on one partition: the given split points, or
    time-balanced stages (``virtual`` per stage actor); the (schedule, m) the schedule refuses under
    ``skipped``. Activation memory is modelled for the one-stage-per-actor schedules only."""
    partition: dict[str, Any] = (
        {"split_points": list(split_points)}
        if split_points is not None
        else {
            "balance": "time",
            "sample_input": x,
            "num_microbatches": cfg.balance_microbatches,
            "balance_trials": cfg.balance_trials,
        }
    )
    with PipelineTrainer(
        model,
        cfg.stages,
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=0.0,
        cpus_per_stage=cfg.cpus_per_stage,
        use_gpu=cfg.use_gpu,
        schedule=schedules[0],
        virtual_stages=virtual,
        memory_format=cfg.memory_format,
        compile=cfg.compile,
        **partition,
    ) as trainer:
        plan = [dataclasses.asdict(stage) for stage in trainer.plan]
        for trial in trainer.balance_trials:
            print(f"balance trial: {describe_trial(trial)}", flush=True)
        print("stages: " + " | ".join(f"{p['blocks'][0]}..{p['blocks'][-1]}" for p in plan), flush=True)
        runs, skipped = sweep_runs(
            trainer, x, y, Sweep("", "s", tuple(schedules), tuple(microbatches), cfg.warmup, cfg.steps)
        )
    # Activation memory is measured after the timed runs, so it never competes with them for CPUs.
    stages = stage_modules(model, [stage["blocks"] for stage in plan])
    per_microbatch: dict[int, list[int]] = {}  # m -> bytes per stage of micro-batch 0, the largest
    for run in runs:
        m = run["microbatches"]
        run["samples_per_second"] = cfg.global_batch_size / run["step_seconds"]["median"]
        if virtual > 1:
            continue
        if m not in per_microbatch:
            first = split_batch(x, y, m)[0]
            per_microbatch[m] = saved_activation_bytes(stages, first.inputs, first.targets)
        held = max_in_flight(run["schedule"], cfg.stages, m)
        run["peak_activation_bytes"] = [count * size for count, size in zip(held, per_microbatch[m])]
    return {
        "plan": plan,
        "balance_trials": [trial.as_dict() for trial in trainer.balance_trials],
        "runs": runs,
        "skipped": skipped,
    }
