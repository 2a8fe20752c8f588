"""The overhead case of ``raytrain-mp bench pipeline`` (``--overhead``, on by default;
``results["overhead"]``): ours against native where only the pipeline machinery costs time.

Job: run a seeded MLP whose compute is negligible (``shared.seeded_mlp``: 32 features, 64 hidden,
10 classes, 3 Linear layers, one pipeline block each; more when stages x virtual stages need more),
batch ``--overhead-batch-size``, cut evenly into ``--stages`` stages, ours (``PipelineTrainer``,
``virtual_stages=2`` for the interleaved schedules) and native (its own torchrun) over
``--overhead-schedules`` x ``--overhead-microbatches``, ``--overhead-steps`` timed steps after
``OVERHEAD_WARMUP`` untimed ones, in ``--overhead-rounds`` rounds of ours then native whose steps
are pooled (``overhead_rounds``). ``results["overhead"]["runs"]`` holds per (schedule, m) ours'
and native milliseconds per step, ``ours_in_ranks_ms`` (the part of ours spent inside the stage
actors, ``PipelineTrainer.stats``: what is left is the Ray call per step), ``ours_queued_ms`` (as
the run loop trains: ``--overhead-steps-per-call`` steps a Ray call, the next call queued behind
the running one, ``queued_step_seconds``; the ResNet figures queue one step a call),
``native_queued_ms`` (torch's steps back to back in groups of as many, one barrier a group: the
same mean over a call's steps that ours' queued figure is), ``native_over_ours`` (and
``native_over_ours_in_ranks``, ``native_over_ours_queued``, and
``native_over_ours_queued_by_round``) (native median / ours; >= 1: ours is at least as fast),
ours' measured bubble fraction and, where it has one, the schedule's ideal bubble
(``schedule.ideal_bubble``: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved);
``summary.overhead_native_over_ours`` (and ``..._queued``) is that ratio per schedule at m=8
(``RATIO_AT_M``); ``report.plot_overhead`` draws milliseconds per step against m
(``overhead.png``).

Invariants:
- The two sides run the same seeded MLP, batch, stage cut (``shared.even_cut``), loss, optimizer
  and (schedule, m) points (``overhead_sweep``); it is timed while no other stages or ranks run,
  and it uses only ``PipelineTrainer``'s public interface (constructor, ``set_schedule``,
  ``train_step``, ``stats``, ``shutdown``).
- The two sides alternate within a minute or two, so a shared machine's drift in speed falls on
  both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raytrain_mp.bench.common import pooled
from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline.native import native_runs
from raytrain_mp.bench.pipeline.shared import (
    LR,
    MLP_CLASSES,
    MLP_FEATURES,
    MLP_HIDDEN,
    MOMENTUM,
    Sweep,
    even_cut,
    find_run,
    in_ms,
    seeded_mlp,
    virtual_stages,
)
from raytrain_mp.bench.pipeline.timing import sweep_runs
from raytrain_mp.pipeline import PipelineTrainer

OVERHEAD_WARMUP = 3  # untimed steps before each overhead figure (the native stages infer shapes in the first)
RATIO_AT_M = 8  # summary.overhead_native_over_ours compares the schedules at this m


def mlp_layers(cfg: BenchPipelineConfig) -> int:
    """3, or as many as the overhead schedules' model chunks (stages x virtual stages) need."""
    return max(3, cfg.stages * max(virtual_stages(s) for s in cfg.overhead_schedules))


def overhead_sweep(cfg: BenchPipelineConfig) -> Sweep:
    """The overhead case's points, the same for ours and native: every schedule x every m (sorted)."""
    microbatches = tuple(sorted(set(cfg.overhead_microbatches)))
    return Sweep(
        "overhead ",
        "ms",
        cfg.overhead_schedules,
        microbatches,
        OVERHEAD_WARMUP,
        cfg.overhead_steps,
        cfg.overhead_steps_per_call,
    )


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
            model,
            num_stages=cfg.stages,
            split_points=points,
            schedule=schedules[0],
            num_microbatches=max(cfg.overhead_microbatches),
            optimizer="sgd",
            lr=LR,
            momentum=MOMENTUM,
            weight_decay=0.0,
            use_gpu=cfg.use_gpu,
            cpus_per_stage=cfg.cpus_per_stage,
            virtual_stages=virtual,
        )
        layouts.append(
            {
                "virtual_stages": virtual,
                "split_points": points,
                "schedules": list(schedules),
                "stage_niceness": trainer.niceness,
            }
        )
        try:
            print(
                f"overhead case: {len(points) + 1}-chunk MLP on {cfg.stages} stages, cut before {', '.join(points)}",
                flush=True,
            )
            done, refused = sweep_runs(trainer, x, y, dataclasses.replace(overhead_sweep(cfg), schedules=schedules))
        finally:
            trainer.shutdown()
        runs += [{**run, "virtual_stages": virtual} for run in done]
        skipped += refused
    return {"layouts": layouts, "runs": runs, "skipped": skipped}


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
                for theirs, queued in zip(
                    peer["round_medians"][back_to_back], run["round_medians"]["queued_step_seconds"]
                )
            ]
        runs.append(entry)
    layers = mlp_layers(cfg)
    return {
        "model": (
            f"MLP {MLP_FEATURES}-{'-'.join([str(MLP_HIDDEN)] * (layers - 1))}-{MLP_CLASSES}, "
            f"ReLU, {layers} Linear layers"
        ),
        "batch_size": cfg.overhead_batch_size,
        "stages": cfg.stages,
        "warmup": OVERHEAD_WARMUP,
        "steps": cfg.overhead_steps,
        "steps_per_call": cfg.overhead_steps_per_call,
        "rounds": cfg.overhead_rounds,
        "layouts": ours["layouts"],
        "runs": runs,
        "skipped": [
            {"side": side, **skip}
            for side, figures in (("ours", ours), ("native", native))
            for skip in figures["skipped"]
        ],
        "native": {key: native[key] for key in ("api", "launcher", "backend", "device", "world", "threads")},
    }


def overhead_ratios(overhead: dict[str, Any], key: str = "native_over_ours") -> dict[str, float]:
    """``summary.overhead_native_over_ours`` (``key``; ``native_over_ours_queued`` for steps queued
    as the run loop queues them): per schedule, native / ours at m = ``RATIO_AT_M`` (schedules
    without that point measured on both sides are left out)."""
    return {run["schedule"]: run[key] for run in overhead["runs"] if run["microbatches"] == RATIO_AT_M and key in run}
