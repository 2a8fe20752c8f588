"""``raytrain-mp bench pipeline``: one process vs naive model parallel vs our pipelined schedules
vs PyTorch's own ``torch.distributed.pipelining``, and ours vs native where only the pipeline
machinery costs time.

Job: time one training step (forward, backward, SGD step) of the same model on the same random
in-memory batch in each of these ways, and write ``results.json`` plus two plots (three with the
overhead case):

- one process with ``--threads`` torch threads (on GPU 0 with ``--use-gpu``), the whole batch at once;
- the same process with gradient accumulation over m micro-batches: on a CPU a smaller
  micro-batch is itself faster per sample (caches), so this separates that gain from the gain of
  overlapping stages;
- ``PipelineTrainer`` with the seeds' fixed split (``--split-points``, default before ``layer3``),
  GPipe and 1F1B over m=1 and every m of ``--microbatches``, and with time-balanced stages
  (``--balanced``), GPipe over ``--microbatches`` only, and time-balanced ``INTERLEAVED_VIRTUAL``
  stages per actor (``--interleaved``), interleaved 1F1B over ``--microbatches``; GPipe with m=1 on the seeds' split is naive
  model parallelism (the seeds' ``ModelParallelResNet50``);
- the native peer: ``bench.pipeline_native`` under torchrun, one rank per stage with
  ``--cpus-per-stage`` threads (gloo on CPU, NCCL with a GPU per rank), the seeds'-split stages
  wrapped in ``torch.distributed.pipelining.PipelineStage`` and run by ``ScheduleGPipe`` and
  ``Schedule1F1B`` over the same m (``results["native"]``; a (schedule, m) the API refuses, such
  as 1F1B with m < stages, is listed under ``skipped`` with the reason). Ours and native on the
  seeds' split run ``--resnet-rounds`` times in turn (ours, then native), each side's steps
  pooled (``seeds_split_rounds``; ``round_medians`` per point). ``summary.ours_over_native``
  is, per schedule and m, native median step seconds / ours on the seeds' split (>1: ours is
  faster), and ``ours_over_native_by_round`` the same ratio round by round. A failing torchrun
  fails the benchmark.
- the overhead case (``--overhead``, on by default): a seeded MLP whose compute is negligible
  (``seeded_mlp``: 32 features, 64 hidden, 10 classes, 3 Linear layers, one pipeline block each;
  more when stages x virtual stages need more), batch ``--overhead-batch-size``, cut evenly into
  ``--stages`` stages, ours (``PipelineTrainer``, ``virtual_stages=2`` for
  the interleaved schedules) and native (its own torchrun) over
  ``--overhead-schedules`` x ``--overhead-microbatches``, ``--overhead-steps`` timed steps after
  ``OVERHEAD_WARMUP`` untimed ones, in ``--overhead-rounds`` rounds of ours then native whose
  steps are pooled (``overhead_rounds``). ``results["overhead"]["runs"]`` holds per (schedule, m) ours'
  and native milliseconds per step, ``ours_in_ranks_ms`` (the part of ours spent inside the stage
  actors, ``PipelineTrainer.stats``: what is left is the Ray call per step), ``ours_queued_ms``
  (as the run loop trains: ``--overhead-steps-per-call`` steps a Ray call, the next call queued
  behind the running one, ``queued_step_seconds``; the ResNet figures queue one step a call),
  ``native_queued_ms`` (torch's steps back to back in groups of as many, one barrier a group: the
  same mean over a call's steps that ours' queued figure is), ``native_over_ours`` (and ``native_over_ours_in_ranks``,
  ``native_over_ours_queued``, and ``native_over_ours_queued_by_round``) (native median / ours; >= 1: ours is at least as fast), ours' measured bubble fraction and, where it has one, the schedule's ideal bubble
  (``schedule.ideal_bubble``: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved);
  ``summary.overhead_native_over_ours`` (and ``..._queued``) is that ratio per schedule at m=8;
  ``overhead.png`` plots milliseconds per step against m.
- the hybrid case (``--hybrid``, on by default), data x pipeline: for k = ``--hybrid-workers``
  stage actors, every layout of R replicas x S stages with R x S = k, from pure data parallel
  (R=k, S=1) to pure pipeline (R=1, S=k), on the same model and global batch as the ResNet
  figures, GPipe over R x m = ``--hybrid-microbatches`` micro-batches (the same step in every
  layout), stages cut by parameter count (``results["hybrid"]``, ``summary.hybrid_seconds``);
  GPU stages where the cluster has GPUs.

Devices: ``--use-gpu`` (the default where this machine has a GPU for each stage) puts every stage
actor and native rank on its own GPU (NCCL between them) and the references on GPU 0; with fewer
GPUs than stages it is one error line before anything runs. The references run in a child process
that exits before the pipelines start, so their CUDA context and cached memory leave GPU 0.

Invariants:
- Every step time is the median of ``--steps`` timed steps after ``--warmup`` untimed ones (of
  the rounds' steps pooled where a case runs in rounds), with min and max (``bench.common``);
  every variant starts from the same seeded model and batch.
- A layout's stages start once and the sweep changes only the schedule and m
  (``PipelineTrainer.set_schedule``), so actor start-up and profiling are never timed; the native
  ranks likewise build their model once, and their first step of each (schedule, m), which infers
  the stage's shapes, is a warm-up step. A (schedule, m) that ``set_schedule`` refuses is listed
  under ``skipped`` with its reason. The ResNet and the MLP go through the same timing code
  (``sweep_runs``, and ``bench.pipeline_native.measure`` on the native side).
- The overhead case's two sides run the same seeded MLP, batch, stage cut (``even_cut``), loss,
  optimizer and (schedule, m) points; it is timed while no other stages or ranks run, and it
  uses only ``PipelineTrainer``'s public interface (constructor, ``set_schedule``,
  ``train_step``, ``stats``, ``shutdown``).
- The measured bubble fraction (``PipelineTrainer.stats``) sits next to the schedule's ideal
  bubble (``schedule.ideal_bubble``) and, for GPipe and 1F1B, the bubble a perfect runtime would
  show with the measured stage times (``schedule.bubble_for_stage_times``, for GPipe with each
  stage's forward and backward apart: the stages are rarely equal on a CPU, where per-sample cost
  depends on the micro-batch size); peak activation memory per stage is the largest number of
  micro-batches a stage holds under the schedule times the bytes autograd saves for one
  micro-batch in that stage (measured with ``saved_tensors_hooks`` in the driver, parameters
  excluded).
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
    bench_use_gpu,
    curve_chart,
    in_fresh_process,
    machine,
    summarize,
    timed,
    torchrun,
    write_results,
)
from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.errors import UsageError
from raytrain_mp.models import build_model
from raytrain_mp.optim import build_optimizer
from raytrain_mp.pipeline import (
    PipelineTrainer,
    StageModule,
    build_schedule,
    flatten_model,
    split_batch,
)
from raytrain_mp.pipeline.run import describe_trial
from raytrain_mp.pipeline.schedule import (
    FILL_DRAIN_SCHEDULES,
    FLAT_SCHEDULES,
    FORWARD,
    INTERLEAVED_SCHEDULES,
    bubble_for_stage_times,
    ideal_bubble,
)

LR = 0.01  # small enough that random labels never blow the weights up (NaNs would change the timing)
MOMENTUM = 0.9
MLP_FEATURES, MLP_HIDDEN, MLP_CLASSES = 32, 64, 10  # the overhead case's model: compute is negligible
INTERLEAVED_VIRTUAL = 2  # stages per actor of the interleaved layouts
OVERHEAD_WARMUP = 3  # untimed steps before each overhead figure (the native stages infer shapes in the first)
FORMULA_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # the schedules with a closed-form ideal bubble
RATIO_AT_M = 8  # summary.overhead_native_over_ours compares the schedules at this m


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The (schedule, m) points one model's stages run, and how each is timed; ``label`` prefixes
    its progress lines, which show step times in ``unit``. Plain values: it travels as JSON to the
    native ranks."""

    label: str
    unit: str  # "s" or "ms"
    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    warmup: int
    steps: int
    steps_per_call: int = 1  # of the queued measurement (the run loop's --steps-per-call)


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
    model = build_model(model_name, num_classes, small_stem=None, image_size=image_size)  # the small stem below 64 px
    x = torch.randn(batch_size, 3, image_size, image_size)
    y = torch.randint(num_classes, (batch_size,))
    return model, x, y


def seeded_mlp(layers: int, batch_size: int, seed: int) -> tuple[nn.Module, Tensor, Tensor]:
    """The overhead case's model, ``layers`` Linear layers with ReLUs between them (one pipeline
    block each, ``flatten_model``), and its random batch; seeded like ``seeded_setup``."""
    torch.manual_seed(seed)
    widths = [MLP_FEATURES] + [MLP_HIDDEN] * (layers - 1) + [MLP_CLASSES]
    modules: list[nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        modules += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    model = nn.Sequential(*modules[:-1])
    x = torch.randn(batch_size, MLP_FEATURES)
    y = torch.randint(MLP_CLASSES, (batch_size,))
    return model, x, y


def virtual_stages(schedule: str) -> int:
    """Model chunks per stage actor: ``INTERLEAVED_VIRTUAL`` for the interleaved schedules, else 1."""
    return INTERLEAVED_VIRTUAL if schedule in INTERLEAVED_SCHEDULES else 1


def mlp_layers(cfg: BenchPipelineConfig) -> int:
    """3, or as many as the overhead schedules' model chunks (stages x virtual stages) need."""
    return max(3, cfg.stages * max(virtual_stages(s) for s in cfg.overhead_schedules))


def even_cut(model: nn.Module, chunks: int) -> tuple[list[str], list[list[str]]]:
    """(split points, block names per chunk) cutting ``model``'s blocks into ``chunks`` runs whose
    lengths differ by at most one; the earlier runs are the shorter."""
    names = [block.name for block in flatten_model(model)]
    cuts = [len(names) * i // chunks for i in range(1, chunks)]
    return [names[c] for c in cuts], [names[a:b] for a, b in zip([0, *cuts], [*cuts, len(names)])]


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


def progress(label: str, step_seconds: dict[str, float], unit: str = "s") -> None:
    """One line per figure as it is measured (a default run takes minutes), in ``unit`` (s, ms)."""
    shown = in_ms(step_seconds) if unit == "ms" else step_seconds
    print(f"{label}: {shown['median']:.3f} {unit}/step (min {shown['min']:.3f}, max {shown['max']:.3f})", flush=True)


def in_ms(step_seconds: dict[str, float]) -> dict[str, float]:
    return {key: value * 1000 for key, value in step_seconds.items()}


def one_process(cfg: BenchPipelineConfig, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Any]:
    """Step times of one process (GPU 0 with ``--use-gpu``): the whole batch, and gradient
    accumulation over each m > 1. Run it in a fresh process (``in_fresh_process``): it sets
    torch's threads, and on a GPU its CUDA context must not outlive it."""
    device = torch.device("cuda", 0) if cfg.use_gpu else torch.device("cpu")
    torch.set_num_threads(cfg.threads)
    model = copy.deepcopy(model).to(device).train()
    optimizer = sgd(model)
    x, y = x.to(device), y.to(device)
    figures = {}
    for m in cfg.sweep:
        seconds = timed(lambda m=m: accumulation_step(model, optimizer, x, y, m), cfg.warmup, cfg.steps)
        figures[m] = {"microbatches": m, "step_seconds": summarize(seconds)}
        progress(f"one process, {cfg.threads} threads, m={m}", figures[m]["step_seconds"])
    return {
        "device": str(device),
        "threads": cfg.threads,
        "whole_batch": figures[1],
        "grad_accum": [figures[m] for m in cfg.sweep if m > 1],
    }


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
    for i, _ in enumerate(trainer.train_steps(((x, y, None) for _ in range(calls * per_call)), steps_per_call=per_call)):
        if i % per_call == 0:  # a call's steps arrive together: its first marks its end
            ends.append(time.perf_counter())
        if i % per_call == per_call - 1:
            bubbles.append(trainer.stats(reset=True)["bubble_fraction"])
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
    measured = per_step[sweep.warmup:]
    queued, queued_bubbles = queued_steps(trainer, x, y, sweep)
    progress(f"{sweep.label}{schedule} m={m}, {sweep.steps_per_call} step(s) a call, queued", summarize(queued), sweep.unit)
    busy = [summarize(per_stage) for per_stage in zip(*(s["busy_seconds"] for s in measured))]
    forward_busy = [summarize(per_stage) for per_stage in zip(*(s["forward_busy_seconds"] for s in measured))]
    samples = {
        "step_seconds": seconds,
        "queued_step_seconds": queued,
        "bubble_fraction": [s["bubble_fraction"] for s in measured],
        "queued_bubble_fraction": queued_bubbles,
        "rank_step_seconds": [s["rank_seconds_per_step"] for s in measured],
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
    if schedule in FORMULA_SCHEDULES:
        run["bubble_formula"] = ideal_bubble(schedule, trainer.num_stages, m, trainer.virtual_stages)
    if schedule in FLAT_SCHEDULES:
        stage_busy = [b["median"] for b in busy[: trainer.num_stages]]
        # GPipe's phases count apart (each pays its own slowest stage); 1F1B alternates them.
        forward = [f["median"] for f in forward_busy[: trainer.num_stages]] if schedule in FILL_DRAIN_SCHEDULES else None
        run["bubble_for_stage_times"] = bubble_for_stage_times(stage_busy, m, forward)
    return run


def sweep_runs(trainer: PipelineTrainer, x: Tensor, y: Tensor, sweep: Sweep) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
        else {"balance": "time", "sample_input": x, "num_microbatches": cfg.balance_microbatches, "balance_trials": cfg.balance_trials}
    )
    with PipelineTrainer(
        model, cfg.stages, lr=LR, momentum=MOMENTUM, weight_decay=0.0, cpus_per_stage=cfg.cpus_per_stage,
        use_gpu=cfg.use_gpu, schedule=schedules[0], virtual_stages=virtual, memory_format=cfg.memory_format, **partition,
    ) as trainer:  # fmt: skip
        plan = [dataclasses.asdict(stage) for stage in trainer.plan]
        for trial in trainer.balance_trials:
            print(f"balance trial: {describe_trial(trial)}", flush=True)
        print("stages: " + " | ".join(f"{p['blocks'][0]}..{p['blocks'][-1]}" for p in plan), flush=True)
        runs, skipped = sweep_runs(trainer, x, y, Sweep("", "s", tuple(schedules), tuple(microbatches), cfg.warmup, cfg.steps))
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
    return {"plan": plan, "balance_trials": trainer.balance_trials, "runs": runs, "skipped": skipped}


def overhead_sweep(cfg: BenchPipelineConfig) -> Sweep:
    """The overhead case's points, the same for ours and native: every schedule x every m (sorted)."""
    microbatches = tuple(sorted(set(cfg.overhead_microbatches)))
    return Sweep("overhead ", "ms", cfg.overhead_schedules, microbatches, OVERHEAD_WARMUP, cfg.overhead_steps, cfg.overhead_steps_per_call)


def overhead_runs(cfg: BenchPipelineConfig) -> dict[str, Any]:
    """Ours on the overhead case: the seeded MLP cut evenly into stages x virtual stages chunks,
    one ``PipelineTrainer`` per virtual-stage count (started once), every (schedule, m) of the
    overhead sweep on it; step times in milliseconds."""
    model, x, y = seeded_mlp(mlp_layers(cfg), cfg.overhead_batch_size, cfg.seed)
    runs, skipped, layouts = [], [], []
    for virtual in dict.fromkeys(virtual_stages(s) for s in cfg.overhead_schedules):
        schedules = tuple(s for s in cfg.overhead_schedules if virtual_stages(s) == virtual)
        points, _ = even_cut(model, cfg.stages * virtual)
        trainer = PipelineTrainer(
            model, num_stages=cfg.stages, split_points=points, schedule=schedules[0], num_microbatches=max(cfg.overhead_microbatches),
            optimizer="sgd", lr=LR, momentum=MOMENTUM, weight_decay=0.0, use_gpu=cfg.use_gpu, cpus_per_stage=cfg.cpus_per_stage,
            virtual_stages=virtual,
        )  # fmt: skip
        layouts.append(
            {"virtual_stages": virtual, "split_points": points, "schedules": list(schedules), "stage_niceness": trainer.niceness}
        )
        try:
            print(f"overhead case: {len(points) + 1}-chunk MLP on {cfg.stages} stages, cut before {', '.join(points)}", flush=True)
            done, refused = sweep_runs(trainer, x, y, dataclasses.replace(overhead_sweep(cfg), schedules=schedules))
        finally:
            trainer.shutdown()
        runs += [{**run, "virtual_stages": virtual} for run in done]
        skipped += refused
    return {"layouts": layouts, "runs": runs, "skipped": skipped}


def hybrid_layouts(workers: int) -> list[tuple[int, int]]:
    """(replicas, stages) of every way to run ``workers`` stage actors: pure data parallel first,
    pure pipeline last."""
    return [(workers // stages, stages) for stages in range(1, workers + 1) if workers % stages == 0]


def hybrid_runs(cfg: BenchPipelineConfig, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Any]:
    """The data x pipeline question for k = ``--hybrid-workers`` actors: every R x S = k layout,
    GPipe over R x m = ``--hybrid-microbatches`` micro-batches of the same global batch (so every
    layout computes the same step), stages cut by parameter count."""
    total = cfg.hybrid_microbatches
    runs = []
    for replicas, stages in hybrid_layouts(cfg.hybrid_workers):
        m = total // replicas
        with PipelineTrainer(
            model, stages, balance="params", num_replicas=replicas, num_microbatches=m, lr=LR, momentum=MOMENTUM,
            weight_decay=0.0, cpus_per_stage=cfg.cpus_per_stage, use_gpu=cfg.use_gpu, memory_format=cfg.memory_format,
        ) as trainer:  # fmt: skip
            sweep = Sweep(f"hybrid R={replicas} x S={stages} ", "s", ("gpipe",), (m,), cfg.warmup, cfg.steps)
            (run,), _ = sweep_runs(trainer, x, y, sweep)
            nodes = len(set(trainer.nodes))
        samples = cfg.global_batch_size / run["step_seconds"]["median"]
        runs.append({"replicas": replicas, "stages": stages, "nodes": nodes, "samples_per_second": samples, **run})
    return {"workers": cfg.hybrid_workers, "microbatches": total, "runs": runs}


def hybrid_seconds(hybrid: dict[str, Any]) -> dict[str, float]:
    """``summary.hybrid_seconds``: median step seconds per layout, keyed ``R{replicas}xS{stages}``."""
    return {f"R{run['replicas']}xS{run['stages']}": run["step_seconds"]["median"] for run in hybrid["runs"]}


def resnet_case(
    cfg: BenchPipelineConfig, plan: Sequence[dict[str, Any]], ours: Sequence[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The native ranks' ResNet case (plain values, it travels as JSON): the name and arguments of
    its seeded setup function, the stages' block names of ``plan`` and the sweep with its timing;
    given ``ours``' runs, the layout each of our stages computed in at each point (``layouts``,
    keyed "schedule m"), for the ranks to compute in too."""
    sweep = Sweep("in our layouts, " if ours is not None else "", "s", ("gpipe", "1f1b"), tuple(sorted(cfg.microbatches)), cfg.warmup, cfg.steps)
    layouts = {} if ours is None else {"layouts": {f"{run['schedule']} {run['microbatches']}": run["memory_formats"] for run in ours}}
    return {
        "setup": "seeded_setup",
        "arguments": {"model_name": cfg.model, "num_classes": cfg.num_classes, "image_size": cfg.image_size,
                      "batch_size": cfg.global_batch_size, "seed": cfg.seed},
        "chunk_blocks": {"1": [list(stage["blocks"]) for stage in plan]},
        **layouts,
        **dataclasses.asdict(sweep),
    }  # fmt: skip


def overhead_case(cfg: BenchPipelineConfig) -> dict[str, Any]:
    """The native ranks' overhead case: the seeded MLP cut as ours is, per virtual-stage count."""
    arguments = {"layers": mlp_layers(cfg), "batch_size": cfg.overhead_batch_size, "seed": cfg.seed}
    return {
        "setup": "seeded_mlp",
        "arguments": arguments,
        # per virtual-stage count (a JSON key is a string): the model's chunks in pipeline order
        "chunk_blocks": {
            str(virtual): even_cut(seeded_mlp(**arguments)[0], cfg.stages * virtual)[1]
            for virtual in dict.fromkeys(virtual_stages(s) for s in cfg.overhead_schedules)
        },
        **dataclasses.asdict(overhead_sweep(cfg)),
    }


def native_runs(
    cfg: BenchPipelineConfig, cases: dict[str, dict[str, Any]], module: str = "raytrain_mp.bench.pipeline_native"
) -> dict[str, Any]:
    """The ``cases`` (``resnet_case``, ``overhead_case``) of ``torch.distributed.pipelining`` in one
    torchrun, one rank per stage, each rank running ``module`` (``bench.pipeline_native``, or what
    wraps its ``main``); raises ``RuntimeError`` when torchrun fails. The figures of each case by
    name, with what ran them (api, launcher, backend, device, world, threads)."""
    what = f"torch.distributed.pipelining benchmark (torchrun, {cfg.stages} ranks)"
    settings = {"threads": cfg.cpus_per_stage, "use_gpu": cfg.use_gpu, "cases": cases}
    native = torchrun(module, cfg.stages, settings, cfg.cpus_per_stage, what)
    described = {
        "api": "torch.distributed.pipelining: PipelineStage + ScheduleGPipe / Schedule1F1B",
        "launcher": f"torchrun --standalone --nproc-per-node {cfg.stages}",
        **{key: value for key, value in native.items() if key != "cases"},
    }
    figures = {}
    for name, case in native["cases"].items():
        label, unit = cases[name]["label"], cases[name]["unit"]
        for run in case["runs"]:
            progress(f"{label}native {run['schedule']} m={run['microbatches']}", run["step_seconds"], unit)
        for skip in case["skipped"]:
            print(f"{label}native {skip['schedule']} m={skip['microbatches']}: skipped, {skip['reason']}", flush=True)
        figures[name] = {**described, **case}
    return figures


def native_resnet(cfg: BenchPipelineConfig, ours: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One round of ``results["native"]``: torch's GPipe and 1F1B on the stages of ``ours``' plan
    (the seeds' split), the model as given; unless ``--memory-format contiguous``, also, in the
    same torchrun, ``results["native_ours_layouts"]``: each stage in the layout ours computed it in
    at that point, so that the runtime and the memory format can be told apart."""
    cases = {"native": resnet_case(cfg, ours["plan"])}
    if cfg.memory_format != "contiguous":
        cases["native_ours_layouts"] = resnet_case(cfg, ours["plan"], ours["runs"])
    return {name: {**figures, "split": "fixed"} for name, figures in native_runs(cfg, cases).items()}


def pooled(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The runs of several rounds of one sweep (the same points in the same order) as one: per
    point, each figure of its ``samples`` pooled over the rounds (``samples`` then holds every
    round's) and summarized, its per-round medians under ``round_medians``, and the first round's
    other entries (busy seconds per stage, activation memory: figures measured once a point)."""
    runs = []
    for same in zip(*rounds, strict=True):
        samples = {figure: [value for run in same for value in run["samples"][figure]] for figure in same[0]["samples"]}
        first = {key: value for key, value in same[0].items() if key not in samples}
        runs.append({
            **first, **{figure: summarize(values) for figure, values in samples.items()}, "samples": samples,
            "round_medians": {figure: [run[figure]["median"] for run in same] for figure in samples},
        })  # fmt: skip
    return runs


def seeds_split_rounds(
    cfg: BenchPipelineConfig, model: nn.Module, x: Tensor, y: Tensor
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(ours, the native sides by name: ``native_resnet``) on the seeds' split, ``--resnet-rounds``
    times in turn (ours, then native), each side's runs ``pooled``: the ratio of the two is the
    headline of ours against torch, and on a shared machine a single pass of each lets the drift
    between them fall on one side."""
    ours, native = [], []
    for round_ in range(cfg.resnet_rounds):
        print(f"seeds' split, round {round_ + 1} of {cfg.resnet_rounds}", flush=True)
        ours.append(layout_runs(cfg, model, x, y, cfg.split_points, cfg.sweep))
        native.append(native_resnet(cfg, ours[-1]))

    def one(rounds: list[dict[str, Any]]) -> dict[str, Any]:
        runs = pooled([side["runs"] for side in rounds])
        for run in runs:
            run["samples_per_second"] = cfg.global_batch_size / run["step_seconds"]["median"]
        return {**rounds[0], "runs": runs}

    return one(ours), {name: one([side[name] for side in native]) for name in native[0]}


def overhead_rounds(cfg: BenchPipelineConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ours, native) on the overhead case, ``--overhead-rounds`` times in turn (ours, then
    native), each side's rounds ``pooled``: the two sides alternate within a minute or two, so a
    shared machine's drift in speed falls on both."""
    ours, native = [], []
    for round_ in range(cfg.overhead_rounds):
        print(f"overhead case, round {round_ + 1} of {cfg.overhead_rounds}", flush=True)
        ours.append(overhead_runs(cfg))
        native.append(native_runs(cfg, {"overhead": overhead_case(cfg)})["overhead"])
    return (
        {**ours[0], "runs": pooled([side["runs"] for side in ours])},
        {**native[0], "runs": pooled([side["runs"] for side in native])},
    )


def find_run(layout: dict[str, Any], schedule: str, m: int) -> dict[str, Any] | None:
    return next((r for r in layout["runs"] if r["schedule"] == schedule and r["microbatches"] == m), None)


def best_run(layouts: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(layout name, run) of the fastest pipelined run (m >= 2) of all layouts; the fastest run of
    all when only m=1 was swept."""
    runs = [(name, run) for name, layout in layouts.items() for run in layout["runs"]]
    pipelined = [(name, run) for name, run in runs if run["microbatches"] > 1] or runs
    return min(pipelined, key=lambda item: item[1]["step_seconds"]["median"])


def ratios_to_native(fixed: dict[str, Any], native: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per figure (``step_seconds``, ``queued_step_seconds`` of ours against native's steps, and
    ``by_round``: round by round), schedule and m: native / ours median step seconds on the same
    split (>1: ours is faster)."""
    ratios: dict[str, dict[str, Any]] = {"step_seconds": {}, "queued_step_seconds": {}, "by_round": {}}
    for run in native["runs"]:
        ours = find_run(fixed, run["schedule"], run["microbatches"])
        if ours is None:
            continue
        native_seconds, m = run["step_seconds"]["median"], str(run["microbatches"])
        for figure in ("step_seconds", "queued_step_seconds"):
            ratios[figure].setdefault(run["schedule"], {})[m] = native_seconds / ours[figure]["median"]
        ratios["by_round"].setdefault(run["schedule"], {})[m] = [
            theirs / own for theirs, own in zip(run["round_medians"]["step_seconds"], ours["round_medians"]["step_seconds"])
        ]
    return ratios


def summary(
    local: dict[str, Any], layouts: dict[str, dict[str, Any]], native: dict[str, Any], native_ours_layouts: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The headline ratios of issue 6's goals (higher is better for every ``*_speedup``), and ours
    against the native peer: ``ours_over_native[schedule][m]`` = native / ours step seconds, on
    the same (seeds') split, schedule and m (>1: ours is faster), native running the model as
    given; ``ours_over_native_ours_layouts`` the same against native computing in ours' layouts."""
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
    over = ratios_to_native(layouts["fixed"], native)
    result["ours_over_native"], result["ours_queued_over_native"] = over["step_seconds"], over["queued_step_seconds"]
    result["ours_over_native_by_round"] = over["by_round"]  # how far the pooled ratio moves with the machine's drift
    if native_ours_layouts is not None:
        # the same stages in the same layouts on both sides: the runtimes alone
        result["ours_over_native_ours_layouts"] = ratios_to_native(layouts["fixed"], native_ours_layouts)["step_seconds"]
    _, native_best = best_run({"native": native})
    result["best_native"] = {"schedule": native_best["schedule"], "microbatches": native_best["microbatches"]}
    result["best_native_seconds"] = native_best["step_seconds"]["median"]
    if "balanced" in layouts:
        # GPipe against GPipe: the balanced layout runs no 1F1B.
        fixed_best = min(r["step_seconds"]["median"] for r in layouts["fixed"]["runs"] if r["schedule"] == "gpipe")
        balanced_best = min(r["step_seconds"]["median"] for r in layouts["balanced"]["runs"])
        result["balanced_vs_fixed_speedup"] = fixed_best / balanced_best
        # each cut run before the timed figures (--balance-trials): its bubble then
        result["balanced_trial_bubbles"] = {
            ",".join(trial["split_points"]): trial["bubble_fraction"] for trial in layouts["balanced"]["balance_trials"]
        }
        at8 = find_run(layouts["balanced"], "gpipe", 8)
        if at8 is not None:
            result["balanced_gpipe_m8_bubble_gap"] = abs(at8["bubble_fraction"]["median"] - at8["bubble_formula"])
            result["balanced_gpipe_m8_queued_bubble_gap"] = abs(at8["queued_bubble_fraction"]["median"] - at8["bubble_formula"])
            # what the runtime adds beyond the stages' own imbalance
            result["balanced_gpipe_m8_bubble_over_stage_times"] = at8["bubble_fraction"]["median"] - at8["bubble_for_stage_times"]
    if "interleaved" in layouts:
        at8 = find_run(layouts["interleaved"], "interleaved-1f1b", 8)
        if at8 is not None:
            result["interleaved_1f1b_m8_bubble"] = {
                "measured": at8["bubble_fraction"]["median"], "measured_queued": at8["queued_bubble_fraction"]["median"],
                "formula": at8["bubble_formula"],
            }  # fmt: skip
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
    path: Path, cfg: BenchPipelineConfig, local: dict[str, Any], layouts: dict[str, dict[str, Any]], native: dict[str, Any],
    native_ours_layouts: dict[str, Any] | None = None,
) -> None:
    """Step time against m for every variant: the seeds' split-size curve; native ones dashed
    (dotted: in our stages' layouts)."""

    def points(runs: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
        return [(r["microbatches"], r["step_seconds"]) for r in runs]

    curves = {"one process, grad accum": (points([local["whole_batch"], *local["grad_accum"]]), "-")}
    for name, layout in layouts.items():
        for schedule in dict.fromkeys(r["schedule"] for r in layout["runs"]):
            curves[f"{schedule}, {name} split"] = (points([r for r in layout["runs"] if r["schedule"] == schedule]), "-")
    for schedule in ("gpipe", "1f1b"):
        curves[f"torch {schedule}, {native['split']} split"] = (points([r for r in native["runs"] if r["schedule"] == schedule]), "--")
        if native_ours_layouts is not None:
            runs = [r for r in native_ours_layouts["runs"] if r["schedule"] == schedule]
            curves[f"torch {schedule}, {native['split']} split, our layouts"] = (points(runs), ":")
    title = f"{cfg.model} {cfg.image_size}x{cfg.image_size}, batch {cfg.global_batch_size}, {cfg.stages} stages"
    curve_chart(path, curves, cfg.sweep, "micro-batches per step (m)", "seconds per training step", title)


def overhead_section(cfg: BenchPipelineConfig, ours: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    """``results["overhead"]``: per (schedule, m) ours ran, its milliseconds per step and measured
    bubble fraction (with the ideal one where there is a formula) and, where the native peer ran the same
    point, its milliseconds and ``native_over_ours`` = native / ours median (>= 1: ours is at
    least as fast); what either side skipped, with the reason."""
    runs = []
    for run in ours["runs"]:
        entry = {
            "schedule": run["schedule"],
            "microbatches": run["microbatches"],
            "virtual_stages": run["virtual_stages"],
            "ours_ms": in_ms(run["step_seconds"]),
            "ours_in_ranks_ms": in_ms(run["rank_step_seconds"]),
            "ours_queued_ms": in_ms(run["queued_step_seconds"]),
            "bubble_fraction": run["bubble_fraction"],
            **({"bubble_formula": run["bubble_formula"]} if "bubble_formula" in run else {}),
        }
        peer = find_run(native, run["schedule"], run["microbatches"])
        if peer is not None:
            entry["native_ms"] = in_ms(peer["step_seconds"])
            entry["native_over_ours"] = peer["step_seconds"]["median"] / run["step_seconds"]["median"]
            entry["native_over_ours_in_ranks"] = peer["step_seconds"]["median"] / run["rank_step_seconds"]["median"]
            # like for like: torch's steps back to back in groups as large as ours' calls
            back_to_back = "queued_step_seconds" if "queued_step_seconds" in peer else "step_seconds"
            entry["native_queued_ms"] = in_ms(peer[back_to_back])
            entry["native_over_ours_queued"] = peer[back_to_back]["median"] / run["queued_step_seconds"]["median"]
            # round by round: how far the pooled ratio could move with the machine's drift
            entry["native_over_ours_queued_by_round"] = [
                theirs / queued
                for theirs, queued in zip(peer["round_medians"][back_to_back], run["round_medians"]["queued_step_seconds"])
            ]
        runs.append(entry)
    layers = mlp_layers(cfg)
    return {
        "model": f"MLP {MLP_FEATURES}-{'-'.join([str(MLP_HIDDEN)] * (layers - 1))}-{MLP_CLASSES}, ReLU, {layers} Linear layers",
        "batch_size": cfg.overhead_batch_size,
        "stages": cfg.stages,
        "warmup": OVERHEAD_WARMUP,
        "steps": cfg.overhead_steps,
        "steps_per_call": cfg.overhead_steps_per_call,
        "rounds": cfg.overhead_rounds,
        "layouts": ours["layouts"],
        "runs": runs,
        "skipped": [{"side": side, **skip} for side, figures in (("ours", ours), ("native", native)) for skip in figures["skipped"]],
        "native": {key: native[key] for key in ("api", "launcher", "backend", "device", "world", "threads")},
    }


def overhead_ratios(overhead: dict[str, Any], key: str = "native_over_ours") -> dict[str, float]:
    """``summary.overhead_native_over_ours`` (``key``; ``native_over_ours_queued`` for steps queued
    as the run loop queues them): per schedule, native / ours at m = ``RATIO_AT_M`` (schedules
    without that point measured on both sides are left out)."""
    return {run["schedule"]: run[key] for run in overhead["runs"] if run["microbatches"] == RATIO_AT_M and key in run}


def plot_overhead(path: Path, cfg: BenchPipelineConfig, overhead: dict[str, Any]) -> None:
    """Milliseconds per step against m on the MLP, ours solid and native dashed, per schedule."""
    curves = {}
    for schedule in cfg.overhead_schedules:
        runs = [r for r in overhead["runs"] if r["schedule"] == schedule]
        curves[f"ours {schedule}"] = ([(r["microbatches"], r["ours_ms"]) for r in runs], "-")
        curves[f"ours {schedule}, steps queued"] = ([(r["microbatches"], r["ours_queued_ms"]) for r in runs], ":")
        curves[f"torch {schedule}"] = ([(r["microbatches"], r["native_ms"]) for r in runs if "native_ms" in r], "--")
        curves[f"torch {schedule}, steps back to back"] = (
            [(r["microbatches"], r["native_queued_ms"]) for r in runs if "native_queued_ms" in r], "-."
        )
    title = f"overhead case: {overhead['model']}, batch {cfg.overhead_batch_size}, {cfg.stages} stages"
    curve_chart(path, curves, overhead_sweep(cfg).microbatches, "micro-batches per step (m)", "milliseconds per training step", title)


def run_bench_pipeline(cfg: BenchPipelineConfig) -> dict[str, Any]:
    """Measure every variant on the connected Ray cluster; write results.json and the plots."""
    actors = max(cfg.stages, cfg.hybrid_workers if cfg.hybrid else 0)
    cfg = dataclasses.replace(cfg, use_gpu=bench_use_gpu(cfg.use_gpu, actors))
    if cfg.use_gpu and torch.cuda.device_count() < actors:
        raise UsageError(
            f"--use-gpu: {actors} stages need {actors} GPUs (one each: NCCL ranks cannot share a GPU) and this machine "
            f"has {torch.cuda.device_count()}, where the native peer's ranks run; accepted: --no-use-gpu"
        )
    started = time.perf_counter()
    host = machine()
    model, x, y = seeded_setup(cfg.model, cfg.num_classes, cfg.image_size, cfg.global_batch_size, cfg.seed)

    local = in_fresh_process(one_process, cfg, model, x, y)
    fixed, natives = seeds_split_rounds(cfg, model, x, y)
    native, native_ours_layouts = natives["native"], natives.get("native_ours_layouts")
    layouts = {"fixed": fixed}
    overhead = overhead_rounds(cfg) if cfg.overhead else None
    hybrid = hybrid_runs(cfg, model, x, y) if cfg.hybrid else None
    if cfg.balanced:
        layouts["balanced"] = layout_runs(cfg, model, x, y, None, sorted(cfg.microbatches), schedules=("gpipe",))
    if cfg.interleaved:
        layouts["interleaved"] = layout_runs(
            cfg, model, x, y, None, sorted(cfg.microbatches), schedules=("interleaved-1f1b",), virtual=INTERLEAVED_VIRTUAL
        )

    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plots = [out / "step_time_bars.png", out / "m_curve.png"]
    plot_bars(plots[0], local, layouts, best_run(layouts), native)
    plot_m_curve(plots[1], cfg, local, layouts, native, native_ours_layouts)
    results: dict[str, Any] = {
        "benchmark": "pipeline",
        "machine": host,
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("json", "address", "out", "verbose")},
        "one_process": local,
        "layouts": layouts,
        **natives,
        "summary": summary(local, layouts, native, native_ours_layouts),
    }
    if overhead is not None:
        results["overhead"] = overhead_section(cfg, *overhead)
        results["summary"]["overhead_native_over_ours"] = overhead_ratios(results["overhead"])
        results["summary"]["overhead_native_over_ours_queued"] = overhead_ratios(results["overhead"], "native_over_ours_queued")
        plots.append(out / "overhead.png")
        plot_overhead(plots[-1], cfg, results["overhead"])
    if hybrid is not None:
        results["hybrid"] = hybrid
        results["summary"]["hybrid_seconds"] = hybrid_seconds(hybrid)
    results["elapsed_seconds"] = time.perf_counter() - started
    path = write_results(out, results)
    return {"results": str(path), "plots": [str(plot) for plot in plots], **results["summary"]}
