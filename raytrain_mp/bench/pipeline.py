"""``raytrain-mp bench pipeline``: one process vs naive model parallel vs our pipelined schedules
vs PyTorch's own ``torch.distributed.pipelining``.

Job: time one training step (forward, backward, SGD step) of the same model on the same random
in-memory batch in each of these ways, and write ``results.json`` plus two plots:

- one process with ``--threads`` torch threads, the whole batch at once;
- the same process with gradient accumulation over m micro-batches: on a CPU a smaller
  micro-batch is itself faster per sample (caches), so this separates that gain from the gain of
  overlapping stages;
- ``PipelineTrainer`` with the seeds' fixed split (``--split-points``, default before ``layer3``),
  GPipe and 1F1B over m=1 and every m of ``--microbatches``, and with time-balanced stages
  (``--balanced``), GPipe over ``--microbatches`` only; GPipe with m=1 on the seeds' split is naive
  model parallelism (the seeds' ``ModelParallelResNet50``);
- the native peer: ``bench.pipeline_native`` under torchrun, one rank per stage with
  ``--cpus-per-stage`` threads (gloo on CPU, NCCL with a GPU per rank), the seeds'-split stages
  wrapped in ``torch.distributed.pipelining.PipelineStage`` and run by ``ScheduleGPipe`` and
  ``Schedule1F1B`` over the same m (``results["native"]``; a (schedule, m) the API refuses, such
  as 1F1B with m < stages, is listed under ``skipped`` with the reason). ``summary.ours_over_native``
  is, per schedule and m, native median step seconds / ours on the seeds' split (>1: ours is
  faster). A failing torchrun fails the benchmark.

Invariants:
- Every step time is the median of ``--steps`` timed steps after ``--warmup`` untimed ones, with
  min and max (``bench.common``); every variant starts from the same seeded model and batch.
- A layout's stages start once and the sweep changes only the schedule and m
  (``PipelineTrainer.set_schedule``), so actor start-up and profiling are never timed; the native
  ranks likewise build their model once, and their first step of each (schedule, m), which infers
  the stage's shapes, is a warm-up step.
- The measured bubble fraction (``PipelineTrainer.stats``) sits next to GPipe's formula
  (p-1)/(m+p-1); peak activation memory per stage is the largest number of micro-batches a stage
  holds under the schedule times the bytes autograd saves for one micro-batch in that stage
  (measured with ``saved_tensors_hooks`` in the driver, parameters excluded).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raytrain_mp.bench.common import (
    bar_chart,
    machine,
    pyplot,
    summarize,
    timed,
    torchrun,
    write_results,
)
from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.models import build_model, wants_small_stem
from raytrain_mp.optim import build_optimizer
from raytrain_mp.pipeline import (
    PipelineTrainer,
    StageModule,
    build_schedule,
    flatten_model,
    split_batch,
)
from raytrain_mp.pipeline.schedule import FORWARD

LR = 0.01  # small enough that random labels never blow the weights up (NaNs would change the timing)
MOMENTUM = 0.9


def gpipe_bubble(num_stages: int, num_microbatches: int) -> float:
    """GPipe's idle share when every op costs the same: (p-1)/(m+p-1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


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


def seeded_setup(model_name: str, num_classes: int, image_size: int, batch_size: int, seed: int) -> tuple[nn.Module, Tensor, Tensor]:
    """The model and random batch (inputs, labels) every variant starts from; the native ranks
    call it with the same arguments, so they get the same weights and batch."""
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes, small_stem=wants_small_stem(image_size))
    x = torch.randn(batch_size, 3, image_size, image_size)
    y = torch.randint(num_classes, (batch_size,))
    return model, x, y


def stage_modules(model: nn.Module, stage_blocks: Sequence[Sequence[str]]) -> list[StageModule]:
    """The stages a plan describes (block names per stage), sharing ``model``'s modules."""
    by_name = {block.name: block for block in flatten_model(model)}
    return [StageModule(model, [by_name[name] for name in names]) for names in stage_blocks]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer every variant uses (the pipeline stages build the same one)."""
    return build_optimizer(model.parameters(), "sgd", LR, MOMENTUM, 0.0)


def accumulation_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, m: int) -> None:
    """One optimizer step over the batch as m micro-batches, each loss weighted by its share: the
    computation a pipelined step distributes over the stages (m=1: the plain full-batch step)."""
    for mb in split_batch(x, y, m):
        (F.cross_entropy(model(mb.inputs), mb.targets, reduction="sum") / len(x)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()


def progress(label: str, step_seconds: dict[str, float]) -> None:
    """One line per figure as it is measured (a default run takes minutes)."""
    print(f"{label}: {step_seconds['median']:.3f} s/step (min {step_seconds['min']:.3f}, max {step_seconds['max']:.3f})", flush=True)


def one_process(cfg: BenchPipelineConfig, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Any]:
    """Step times of one process: the whole batch, and gradient accumulation over each m > 1."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        model = copy.deepcopy(model).to(device).train()
        optimizer = sgd(model)
        x, y = x.to(device), y.to(device)
        figures = {}
        for m in cfg.sweep:
            seconds = timed(lambda m=m: accumulation_step(model, optimizer, x, y, m), cfg.warmup, cfg.steps)
            figures[m] = {"microbatches": m, "step_seconds": summarize(seconds)}
            progress(f"one process, {cfg.threads} threads, m={m}", figures[m]["step_seconds"])
    finally:
        torch.set_num_threads(threads)
    return {
        "device": str(device),
        "threads": cfg.threads,
        "whole_batch": figures[1],
        "grad_accum": [figures[m] for m in cfg.sweep if m > 1],
    }


def pipeline_run(cfg: BenchPipelineConfig, trainer: PipelineTrainer, x: Tensor, y: Tensor, schedule: str, m: int) -> dict[str, Any]:
    """Step time, busy time per stage and bubble fraction of one (schedule, m) on running stages."""
    trainer.set_schedule(schedule, m)
    trainer.stats(reset=True)
    per_step: list[dict[str, Any]] = []

    def step() -> None:
        trainer.train_step(x, y)
        per_step.append(trainer.stats(reset=True))

    seconds = timed(step, cfg.warmup, cfg.steps)
    progress(f"{schedule} m={m}", summarize(seconds))
    measured = per_step[cfg.warmup:]
    return {
        "schedule": schedule,
        "microbatches": m,
        "step_seconds": summarize(seconds),
        "busy_seconds": [summarize([s["busy_seconds"][i] for s in measured]) for i in range(cfg.stages)],
        "bubble_fraction": summarize([s["bubble_fraction"] for s in measured]),
        "bubble_formula": gpipe_bubble(cfg.stages, m),
    }


def layout_runs(
    cfg: BenchPipelineConfig,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    split_points: Sequence[str] | None,
    microbatches: Sequence[int],
    schedules: Sequence[str] = ("gpipe", "1f1b"),
) -> dict[str, Any]:
    """Every (schedule, m) of ``schedules`` on one partition: the given split points, or
    time-balanced stages."""
    partition: dict[str, Any] = (
        {"split_points": list(split_points)}
        if split_points is not None
        else {"balance": "time", "sample_input": x, "num_microbatches": cfg.balance_microbatches}
    )
    with PipelineTrainer(
        model, cfg.stages, lr=LR, momentum=MOMENTUM, weight_decay=0.0, cpus_per_stage=cfg.cpus_per_stage, **partition
    ) as trainer:
        plan = [dataclasses.asdict(stage) for stage in trainer.plan]
        print("stages: " + " | ".join(f"{p['blocks'][0]}..{p['blocks'][-1]}" for p in plan), flush=True)
        runs = [
            pipeline_run(cfg, trainer, x, y, schedule, m)
            for schedule in schedules
            for m in microbatches
            if schedule == "gpipe" or m >= cfg.stages  # 1F1B needs a micro-batch per stage
        ]
    # Activation memory is measured after the timed runs, so it never competes with them for CPUs.
    stages = stage_modules(model, [stage["blocks"] for stage in plan])
    per_microbatch: dict[int, list[int]] = {}  # m -> bytes per stage of micro-batch 0, the largest
    for run in runs:
        m = run["microbatches"]
        if m not in per_microbatch:
            first = split_batch(x, y, m)[0]
            per_microbatch[m] = saved_activation_bytes(stages, first.inputs, first.targets)
        held = max_in_flight(run["schedule"], cfg.stages, m)
        run["peak_activation_bytes"] = [count * size for count, size in zip(held, per_microbatch[m])]
        run["samples_per_second"] = cfg.global_batch_size / run["step_seconds"]["median"]
    return {"plan": plan, "runs": runs}


def native_settings(cfg: BenchPipelineConfig, plan: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What ``bench.pipeline_native`` needs (plain values, it travels as JSON): the model and batch
    arguments of ``seeded_setup``, the stages' block names, the sweep and the timing."""
    return {
        "model": cfg.model,
        "num_classes": cfg.num_classes,
        "image_size": cfg.image_size,
        "batch_size": cfg.global_batch_size,
        "seed": cfg.seed,
        "threads": cfg.cpus_per_stage,
        "stage_blocks": [list(stage["blocks"]) for stage in plan],
        "schedules": ["gpipe", "1f1b"],
        "microbatches": sorted(cfg.microbatches),
        "steps": cfg.steps,
        "warmup": cfg.warmup,
    }


def native_runs(cfg: BenchPipelineConfig, plan: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """GPipe and 1F1B of ``torch.distributed.pipelining`` on the stages of ``plan``, one torchrun
    rank per stage; raises ``RuntimeError`` when torchrun fails."""
    what = f"torch.distributed.pipelining benchmark (torchrun, {cfg.stages} ranks)"
    native = torchrun("raytrain_mp.bench.pipeline_native", cfg.stages, native_settings(cfg, plan), cfg.cpus_per_stage, what)
    for run in native["runs"]:
        progress(f"native {run['schedule']} m={run['microbatches']}", run["step_seconds"])
        run["samples_per_second"] = cfg.global_batch_size / run["step_seconds"]["median"]
    for skip in native["skipped"]:
        print(f"native {skip['schedule']} m={skip['microbatches']}: skipped, {skip['reason']}", flush=True)
    return {
        "api": "torch.distributed.pipelining: PipelineStage + ScheduleGPipe / Schedule1F1B",
        "launcher": f"torchrun --standalone --nproc-per-node {cfg.stages}",
        "split": "fixed",
        **native,
    }


def find_run(layout: dict[str, Any], schedule: str, m: int) -> dict[str, Any] | None:
    return next((r for r in layout["runs"] if r["schedule"] == schedule and r["microbatches"] == m), None)


def best_run(layouts: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(layout name, run) of the fastest pipelined run (m >= 2) of all layouts; the fastest run of
    all when only m=1 was swept."""
    runs = [(name, run) for name, layout in layouts.items() for run in layout["runs"]]
    pipelined = [(name, run) for name, run in runs if run["microbatches"] > 1] or runs
    return min(pipelined, key=lambda item: item[1]["step_seconds"]["median"])


def summary(local: dict[str, Any], layouts: dict[str, dict[str, Any]], native: dict[str, Any]) -> dict[str, Any]:
    """The headline ratios of issue 6's goals (higher is better for every ``*_speedup``), and ours
    against the native peer: ``ours_over_native[schedule][m]`` = native / ours step seconds, on
    the same (seeds') split, schedule and m (>1: ours is faster)."""
    naive = find_run(layouts["fixed"], "gpipe", 1)["step_seconds"]["median"]
    whole = local["whole_batch"]["step_seconds"]["median"]
    name, best = best_run(layouts)
    result: dict[str, Any] = {
        "one_process_seconds": whole,
        "naive_model_parallel_seconds": naive,
        "best_pipelined": {"layout": name, "schedule": best["schedule"], "microbatches": best["microbatches"]},
        "best_pipelined_seconds": best["step_seconds"]["median"],
        "best_vs_naive_speedup": naive / best["step_seconds"]["median"],
        "best_vs_one_process_speedup": whole / best["step_seconds"]["median"],
    }
    ours_over_native: dict[str, dict[str, float]] = {}
    for run in native["runs"]:
        ours = find_run(layouts["fixed"], run["schedule"], run["microbatches"])
        if ours is not None:
            ratio = run["step_seconds"]["median"] / ours["step_seconds"]["median"]
            ours_over_native.setdefault(run["schedule"], {})[str(run["microbatches"])] = ratio
    _, native_best = best_run({"native": native})
    result["best_native"] = {"schedule": native_best["schedule"], "microbatches": native_best["microbatches"]}
    result["best_native_seconds"] = native_best["step_seconds"]["median"]
    result["ours_over_native"] = ours_over_native
    if "balanced" in layouts:
        # GPipe against GPipe: the balanced layout runs no 1F1B.
        fixed_best = min(r["step_seconds"]["median"] for r in layouts["fixed"]["runs"] if r["schedule"] == "gpipe")
        balanced_best = min(r["step_seconds"]["median"] for r in layouts["balanced"]["runs"])
        result["balanced_vs_fixed_speedup"] = fixed_best / balanced_best
        at8 = find_run(layouts["balanced"], "gpipe", 8)
        if at8 is not None:
            result["balanced_gpipe_m8_bubble_gap"] = abs(at8["bubble_fraction"]["median"] - at8["bubble_formula"])
    return result


def plot_bars(
    path: Path, local: dict[str, Any], layouts: dict[str, dict[str, Any]], best: tuple[str, dict[str, Any]], native: dict[str, Any]
) -> None:
    """One process / model parallel / pipelined / native pipelined, as the seeds' mp_vs_rn_vs_pp.png."""
    labels = [f"one process\n{local['threads']} threads"]
    figures = [local["whole_batch"]["step_seconds"]]
    if local["grad_accum"]:
        accum = min(local["grad_accum"], key=lambda f: f["step_seconds"]["median"])
        labels.append(f"one process\ngrad accum m={accum['microbatches']}")
        figures.append(accum["step_seconds"])
    for name, layout in layouts.items():
        naive = find_run(layout, "gpipe", 1)
        if naive is not None:  # the balanced layout runs m=1 only when --microbatches asks for it
            labels.append(f"model parallel\n{name} split, m=1")
            figures.append(naive["step_seconds"])
    name, run = best
    labels.append(f"pipelined (best)\n{name} {run['schedule']} m={run['microbatches']}")
    figures.append(run["step_seconds"])
    _, run = best_run({"native": native})
    labels.append(f"torch pipelining (best)\n{native['split']} {run['schedule']} m={run['microbatches']}")
    figures.append(run["step_seconds"])
    bar_chart(path, labels, figures, "seconds per training step", "Step time, median of timed steps (whiskers: min-max)")


def plot_m_curve(
    path: Path, cfg: BenchPipelineConfig, local: dict[str, Any], layouts: dict[str, dict[str, Any]], native: dict[str, Any]
) -> None:
    """Step time against m for every variant: the seeds' split-size curve; native ones dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = {"one process, grad accum": ([local["whole_batch"], *local["grad_accum"]], "-")}
    for name, layout in layouts.items():
        for schedule in ("gpipe", "1f1b"):
            curves[f"{schedule}, {name} split"] = ([r for r in layout["runs"] if r["schedule"] == schedule], "-")
    for schedule in ("gpipe", "1f1b"):
        curves[f"torch {schedule}, {native['split']} split"] = ([r for r in native["runs"] if r["schedule"] == schedule], "--")
    for label, (runs, style) in curves.items():
        if not runs:
            continue
        ms = [r["microbatches"] for r in runs]
        med = [r["step_seconds"]["median"] for r in runs]
        err = [[m - r["step_seconds"]["min"] for m, r in zip(med, runs)], [r["step_seconds"]["max"] - m for m, r in zip(med, runs)]]
        ax.errorbar(ms, med, yerr=err, marker="o", capsize=3, linestyle=style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg.sweep, [str(m) for m in cfg.sweep])
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("seconds per training step")
    ax.set_title(f"{cfg.model} {cfg.image_size}x{cfg.image_size}, batch {cfg.global_batch_size}, {cfg.stages} stages", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench_pipeline(cfg: BenchPipelineConfig) -> dict[str, Any]:
    """Measure every variant on the connected Ray cluster; write results.json and the plots."""
    started = time.perf_counter()
    host = machine()
    model, x, y = seeded_setup(cfg.model, cfg.num_classes, cfg.image_size, cfg.global_batch_size, cfg.seed)

    local = one_process(cfg, model, x, y)
    layouts = {"fixed": layout_runs(cfg, model, x, y, cfg.split_points, cfg.sweep)}
    native = native_runs(cfg, layouts["fixed"]["plan"])
    if cfg.balanced:
        layouts["balanced"] = layout_runs(cfg, model, x, y, None, sorted(cfg.microbatches), schedules=("gpipe",))

    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plot_bars(out / "step_time_bars.png", local, layouts, best_run(layouts), native)
    plot_m_curve(out / "m_curve.png", cfg, local, layouts, native)
    results = {
        "benchmark": "pipeline",
        "machine": host,
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("json", "address", "out", "verbose")},
        "one_process": local,
        "layouts": layouts,
        "native": native,
        "summary": summary(local, layouts, native),
        "elapsed_seconds": time.perf_counter() - started,
    }
    path = write_results(out, results)
    return {"results": str(path), "plots": [str(out / "step_time_bars.png"), str(out / "m_curve.png")], **results["summary"]}
