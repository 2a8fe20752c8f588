"""Where a pipelined step's seconds go, per rank and per op: ours against torch's runtime, side by side.

    python scripts/pipeline_timeline.py [--microbatches 8] [--rounds 3] [--steps 6] [--out pipeline-timeline]

``bench pipeline`` times whole steps on the layer3 split; this opens them. In each of ``--rounds``
rounds it runs what the bench runs on the layer3 split, ours then torch's (``bench.pipeline.layout_runs``:
GPipe and 1F1B at each m, one step a call and queued; then ``native_runs`` under torchrun with each
stage in the layout ours chose, ``resnet_case(..., ours)``), and in every rank of both it records the
span of each ``PipelineStage`` forward and backward inside each schedule step. Ours and torch's
runtime wrap the same ``PipelineStage`` (ours subclasses it), so the spans time the same compute
and leave out the receives each waits on before it.

Writes ``timeline.json`` under ``--out``: per (schedule, m), runtime and rank, the medians over the
steps after each run's warm-up of the step's seconds (``wall``: ``schedule.step``, which leaves out
the optimizer step in both), its forward and backward seconds, what is left (``idle``: waiting on a
peer, and the runtime's own work), the seconds of one forward and one backward, and the ratios torch
/ ours of each; and ``timeline.png``: for each point, the median step of each runtime drawn rank by
rank on one clock; and under ``spans/`` the steps as the ranks recorded them (a JSON line a step).
Seconds on a shared machine drift between minutes; the rounds alternate so that the drift falls on
both, and the ratios are what to read.

How: ``record_spans`` patches torch's ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``
(/ ``backward_weight_one_chunk``) and the schedules' ``step`` in a process, and appends one JSON line
a step to a file of ``SPANS_ENV``'s directory. Ours' stage actors run it as Ray's
``worker_process_setup_hook``; torch's ranks run this file as their torchrun module (``--settings``),
which runs it and then ``bench.pipeline_native``. Steps are told apart by round by the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPANS_ENV = "PIPELINE_TIMELINE_SPANS"  # directory the patched processes append their steps to
RUNTIME_ENV = "PIPELINE_TIMELINE_RUNTIME"  # "ours" or "torch": the name of what records
FIGURES = ("wall", "forward", "backward", "idle", "forward_op", "backward_op")


def record_spans() -> None:
    """In this process, append each pipeline schedule step's spans to ``$SPANS_ENV/<runtime>-<pid>.jsonl``:
    the step's wall-clock start, its seconds, and per op (kind F/B/W, stage index, micro-batch,
    start, end) in seconds from the step's start."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from raytrain_mp.pipeline.schedule import SCHEDULES

    names = {entry.torch_class(): name for name, entry in SCHEDULES.items()}  # "1f1b" for Schedule1F1B
    path = Path(os.environ[SPANS_ENV]) / f"{os.environ[RUNTIME_ENV]}-{os.getpid()}.jsonl"
    ops: list[tuple[str, int, int, float, float]] = []

    def timed(kind: str, original: Any) -> Any:
        def run(self: PipelineStage, chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(self, chunk, *args, **kwargs)
            finally:
                ops.append((kind, self.stage_index, chunk, start, time.perf_counter()))

        return run

    PipelineStage.forward_one_chunk = timed("F", PipelineStage.forward_one_chunk)
    PipelineStage.backward_one_chunk = timed("B", PipelineStage.backward_one_chunk)
    PipelineStage.backward_weight_one_chunk = timed("W", PipelineStage.backward_weight_one_chunk)

    def recorded(original: Any) -> Any:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            ops.clear()
            began, start = time.time(), time.perf_counter()
            result = original(self, *args, **kwargs)
            end = time.perf_counter()
            record = {
                "runtime": os.environ[RUNTIME_ENV],
                "rank": dist.get_rank(),
                "schedule": names[type(self)],
                "microbatches": self._n_microbatches,
                "began": began,
                "wall": end - start,
                "ops": [(kind, stage, chunk, a - start, b - start) for kind, stage, chunk, a, b in ops],
            }
            with path.open("a") as out:
                out.write(json.dumps(record) + "\n")
            return result

        return step

    for schedule in (PipelineScheduleSingle, PipelineScheduleMulti):
        schedule.step = recorded(schedule.step)


def read_steps(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]


def runs_of(
    steps: Sequence[dict[str, Any]], windows: Sequence[tuple[str, int, float, float]]
) -> dict[tuple, list[dict[str, Any]]]:
    """The steps grouped by (schedule, m, runtime, round, rank), in the order they ran; a step's round
    is the window (runtime, round, began, ended) its start falls in."""
    runs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for step in sorted(steps, key=lambda s: s["began"]):
        rounds = [
            r for runtime, r, began, ended in windows if runtime == step["runtime"] and began <= step["began"] <= ended
        ]
        if len(rounds) != 1:
            raise ValueError(f"a {step['runtime']} step at {step['began']} is in {len(rounds)} rounds' windows")
        runs[step["schedule"], step["microbatches"], step["runtime"], rounds[0], step["rank"]].append(step)
    return runs


def step_figures(step: dict[str, Any]) -> dict[str, float]:
    """A step's seconds: wall, in forwards, in backwards (B and W), the rest, and one op's median."""
    forwards = [end - start for kind, _, _, start, end in step["ops"] if kind == "F"]
    backwards = [end - start for kind, _, _, start, end in step["ops"] if kind != "F"]
    return {
        "wall": step["wall"],
        "forward": sum(forwards),
        "backward": sum(backwards),
        "idle": step["wall"] - sum(forwards) - sum(backwards),
        "forward_op": statistics.median(forwards),
        "backward_op": statistics.median(backwards),
    }


def summarize(runs: dict[tuple, list[dict[str, Any]]], warmup: int) -> list[dict[str, Any]]:
    """Per (schedule, m): per runtime and rank the median of each figure over every round's steps
    after its first ``warmup`` (and how many steps that is), and torch / ours of each."""
    pooled: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    for (schedule, m, runtime, _, rank), steps in runs.items():
        pooled[schedule, m, runtime, rank] += [step_figures(step) for step in steps[warmup:]]
    points = []
    for schedule, m in sorted({key[:2] for key in pooled}):
        by_runtime = {
            runtime: [
                {"rank": rank, "steps": len(figures), **{f: statistics.median(s[f] for s in figures) for f in FIGURES}}
                for (s_, m_, runtime_, rank), figures in sorted(pooled.items())
                if (s_, m_, runtime_) == (schedule, m, runtime)
            ]
            for runtime in ("ours", "torch")
        }
        ratios = [
            {"rank": o["rank"], **{f: t[f] / o[f] for f in FIGURES}}
            for o, t in zip(by_runtime["ours"], by_runtime["torch"], strict=True)
        ]
        points.append({"schedule": schedule, "microbatches": m, "ranks": by_runtime, "torch_over_ours": ratios})
    return points


def median_step(
    runs: dict[tuple, list[dict[str, Any]]], schedule: str, m: int, runtime: str, warmup: int
) -> list[dict[str, Any]]:
    """One whole step of ``runtime`` at (schedule, m), every rank's record of it: the step whose
    rank 0 wall is the median of the steps after warm-up (the k-th step of a run is the same step on
    every rank)."""
    candidates = []
    for (s, m_, r, round_, rank), steps in runs.items():
        if (s, m_, r, rank) == (schedule, m, runtime, 0):
            candidates += [(step["wall"], round_, k) for k, step in enumerate(steps) if k >= warmup]
    _, round_, k = sorted(candidates)[len(candidates) // 2]
    ranks = sorted(rank for (s, m_, r, rd, rank) in runs if (s, m_, r, rd) == (schedule, m, runtime, round_))
    return [runs[schedule, m, runtime, round_, rank][k] for rank in ranks]


def plot(runs: dict[tuple, list[dict[str, Any]]], points: Sequence[dict[str, Any]], warmup: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p["schedule"], p["microbatches"], runtime) for p in points for runtime in ("ours", "torch")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.4 + 1.1 * len(panels)), squeeze=False)
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    steps = {panel: median_step(runs, *panel, warmup) for panel in panels}
    longest = defaultdict(float)  # per point, so that its two runtimes share a time axis
    for (schedule, m, _), step in steps.items():
        zero = min(rank["began"] for rank in step)
        longest[schedule, m] = max(longest[schedule, m], *(rank["began"] - zero + rank["wall"] for rank in step))
    for ax, (schedule, m, runtime) in zip(axes[:, 0], panels):
        step = steps[schedule, m, runtime]
        zero = min(rank["began"] for rank in step)
        for rank in step:
            offset = rank["began"] - zero
            for kind, _, chunk, start, end in rank["ops"]:
                ax.barh(rank["rank"], end - start, left=offset + start, color=colors[kind], edgecolor="white")
                ax.text(offset + (start + end) / 2, rank["rank"], str(chunk), ha="center", va="center", fontsize=7)
            ax.plot([offset + rank["wall"]] * 2, [rank["rank"] - 0.45, rank["rank"] + 0.45], color="black")
        ax.set_yticks([rank["rank"] for rank in step], [f"rank {rank['rank']}" for rank in step])
        ax.invert_yaxis()
        ax.set_xlim(0, 1.01 * longest[schedule, m])
        ax.set_title(
            f"{runtime}: {schedule} m={m}, its median step (blue forward, orange backward, green weight gradients of "
            "a split backward, | end)",
            fontsize=9,
        )
    axes[-1, 0].set_xlabel("seconds from the step's first start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument(
        "--memory-format", default="auto", help="of ours; torch's ranks compute in the layouts ours chose"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps a point, a round, a runtime")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("pipeline-timeline"))
    args = parser.parse_args(argv)

    import ray

    import raytrain_mp.bench.pipeline as bench
    from raytrain_mp.bench.config import BenchPipelineConfig

    cfg = BenchPipelineConfig(
        out=str(args.out),
        model=args.model,
        image_size=args.image_size,
        global_batch_size=args.global_batch_size,
        microbatches=tuple(args.microbatches),
        memory_format=args.memory_format,
        steps=args.steps,
        warmup=args.warmup,
        overhead=False,
        hybrid=False,
        balanced=False,
        interleaved=False,
    )
    spans = args.out / "spans"
    spans.mkdir(parents=True, exist_ok=True)
    for old in spans.glob("*.jsonl"):
        old.unlink()
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    os.environ.update(
        {SPANS_ENV: str(spans.resolve()), RUNTIME_ENV: "torch", "PYTHONPATH": path}
    )  # torchrun's ranks inherit these
    model, x, y = bench.seeded_setup(cfg.model, cfg.num_classes, cfg.image_size, cfg.global_batch_size, cfg.seed)
    windows: list[tuple[str, int, float, float]] = []
    ray.init(
        address="local",
        num_cpus=cfg.stages * cfg.cpus_per_stage,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": f"{Path(__file__).stem}.record_spans",
            "env_vars": {**{k: os.environ[k] for k in (SPANS_ENV, "PYTHONPATH")}, RUNTIME_ENV: "ours"},
        },
    )
    try:
        for round_ in range(args.rounds):
            began = time.time()
            ours = bench.layout_runs(cfg, model, x, y, cfg.split_points, cfg.microbatches)
            windows.append(("ours", round_, began, time.time()))
            began = time.time()
            bench.native_runs(
                cfg, {"ours_layouts": bench.resnet_case(cfg, ours["plan"], ours["runs"])}, module=Path(__file__).stem
            )
            windows.append(("torch", round_, began, time.time()))
    finally:
        ray.shutdown()
    runs = runs_of(read_steps(spans), windows)
    points = summarize(runs, args.warmup)
    (args.out / "timeline.json").write_text(
        json.dumps({"settings": vars(args) | {"out": str(args.out)}, "points": points}, indent=1)
    )
    plot(runs, points, args.warmup, args.out / "timeline.png")
    for point in points:
        for ratio in point["torch_over_ours"]:
            print(
                f"{point['schedule']} m={point['microbatches']} rank {ratio['rank']}: torch / ours "
                + ", ".join(f"{f} {ratio[f]:.3f}" for f in FIGURES)
            )
    print(f"wrote {args.out / 'timeline.json'} and {args.out / 'timeline.png'}")


if __name__ == "__main__":
    if "--settings" in sys.argv:  # a torchrun rank of native_runs: record, then run torch's side
        record_spans()
        from raytrain_mp.bench.pipeline_native import main as native_main

        native_main()
    else:
        main()
