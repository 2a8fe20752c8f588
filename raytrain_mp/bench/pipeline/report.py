"""The report of ``raytrain-mp bench pipeline``: ``results["summary"]`` and the plots.

Job: from the cases' figures, the headline ratios (``summary``: one process, naive model parallel,
the best pipelined run, ours against native, the balanced and interleaved bubbles) and the plots
``step_time_bars.png`` (``plot_bars``), ``m_curve.png`` (``plot_m_curve``) and, with the
overhead case, ``overhead.png`` (``plot_overhead``).

Invariants: it measures nothing and changes no figure it is given; a ratio of two sides is of
their medians, taken only where both ran the same (schedule, m) (higher is better for every
``*_speedup``; for ``ours_over_native``, >1: ours is faster).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raytrain_mp.bench.common import bar_chart, curve_chart
from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline.overhead import overhead_sweep
from raytrain_mp.bench.pipeline.shared import find_run


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
            theirs / own
            for theirs, own in zip(run["round_medians"]["step_seconds"], ours["round_medians"]["step_seconds"])
        ]
    return ratios


def summary(
    local: dict[str, Any],
    layouts: dict[str, dict[str, Any]],
    native: dict[str, Any],
    native_ours_layouts: dict[str, Any] | None = None,
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
        result["ours_over_native_ours_layouts"] = ratios_to_native(layouts["fixed"], native_ours_layouts)[
            "step_seconds"
        ]
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
            result["balanced_gpipe_m8_queued_bubble_gap"] = abs(
                at8["queued_bubble_fraction"]["median"] - at8["bubble_formula"]
            )
            # what the runtime adds beyond the stages' own imbalance
            result["balanced_gpipe_m8_bubble_over_stage_times"] = (
                at8["bubble_fraction"]["median"] - at8["bubble_for_stage_times"]
            )
    if "interleaved" in layouts:
        at8 = find_run(layouts["interleaved"], "interleaved-1f1b", 8)
        if at8 is not None:
            result["interleaved_1f1b_m8_bubble"] = {
                "measured": at8["bubble_fraction"]["median"],
                "measured_queued": at8["queued_bubble_fraction"]["median"],
                "formula": at8["bubble_formula"],
            }
    return result


def plot_bars(
    path: Path,
    local: dict[str, Any],
    layouts: dict[str, dict[str, Any]],
    best: tuple[str, dict[str, Any]],
    native: dict[str, Any],
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
    bar_chart(
        path, labels, figures, "seconds per training step", "Step time, median of timed steps (whiskers: min-max)"
    )


def plot_m_curve(
    path: Path,
    cfg: BenchPipelineConfig,
    local: dict[str, Any],
    layouts: dict[str, dict[str, Any]],
    native: dict[str, Any],
    native_ours_layouts: dict[str, Any] | None = None,
) -> None:
    """Step time against m for every variant: the seeds' split-size curve; native ones dashed
    (dotted: in our stages' layouts)."""

    def points(runs: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
        return [(r["microbatches"], r["step_seconds"]) for r in runs]

    curves = {"one process, grad accum": (points([local["whole_batch"], *local["grad_accum"]]), "-")}
    for name, layout in layouts.items():
        for schedule in dict.fromkeys(r["schedule"] for r in layout["runs"]):
            curves[f"{schedule}, {name} split"] = (
                points([r for r in layout["runs"] if r["schedule"] == schedule]),
                "-",
            )
    for schedule in ("gpipe", "1f1b"):
        curves[f"torch {schedule}, {native['split']} split"] = (
            points([r for r in native["runs"] if r["schedule"] == schedule]),
            "--",
        )
        if native_ours_layouts is not None:
            runs = [r for r in native_ours_layouts["runs"] if r["schedule"] == schedule]
            curves[f"torch {schedule}, {native['split']} split, our layouts"] = (points(runs), ":")
    title = f"{cfg.model} {cfg.image_size}x{cfg.image_size}, batch {cfg.global_batch_size}, {cfg.stages} stages"
    curve_chart(path, curves, cfg.sweep, "micro-batches per step (m)", "seconds per training step", title)


def plot_overhead(path: Path, cfg: BenchPipelineConfig, overhead: dict[str, Any]) -> None:
    """Milliseconds per step against m on the MLP, ours solid and native dashed, per schedule."""
    curves = {}
    for schedule in cfg.overhead_schedules:
        runs = [r for r in overhead["runs"] if r["schedule"] == schedule]
        curves[f"ours {schedule}"] = ([(r["microbatches"], r["ours_ms"]) for r in runs], "-")
        curves[f"ours {schedule}, steps queued"] = ([(r["microbatches"], r["ours_queued_ms"]) for r in runs], ":")
        curves[f"torch {schedule}"] = ([(r["microbatches"], r["native_ms"]) for r in runs if "native_ms" in r], "--")
        curves[f"torch {schedule}, steps back to back"] = (
            [(r["microbatches"], r["native_queued_ms"]) for r in runs if "native_queued_ms" in r],
            "-.",
        )
    title = f"overhead case: {overhead['model']}, batch {cfg.overhead_batch_size}, {cfg.stages} stages"
    curve_chart(
        path,
        curves,
        overhead_sweep(cfg).microbatches,
        "micro-batches per step (m)",
        "milliseconds per training step",
        title,
    )
