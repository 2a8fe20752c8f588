"""Ours against torch's pipeline runtime on ResNet-50's seeds' split, in alternating rounds.

    python scripts/pipeline_vs_torch_rounds.py [--rounds 3] [--microbatches 4,8] [--steps 5]

``bench pipeline`` times ours on the seeds' split, then torch's runtime under torchrun, once,
with 3 steps a point: a shared machine's drift between the two falls on one side. This runs
the same two measurements (``bench.pipeline.layout_runs`` and ``native_resnet``, GPipe and 1F1B
at each m of ``--microbatches``, ``--steps`` timed steps after one warm-up) ``--rounds`` times in
turn on a local Ray of 2 CPUs without a dashboard, pools each side's steps over the rounds, and
prints one JSON object: per (schedule, m), the pooled medians of ours one step at a time, ours
queued (as the run loop trains), torch, and the ratios torch / ours, with the per-round medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import ray

from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline import layout_runs, native_resnet, seeded_setup

SIDES = {"ours": "step_seconds", "ours_queued": "queued_step_seconds"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cfg = BenchPipelineConfig(
        out="", microbatches=tuple(int(m) for m in args.microbatches.split(",")), steps=args.steps, warmup=1,
        overhead=False, hybrid=False, balanced=False, interleaved=False,
    )  # fmt: skip
    model, x, y = seeded_setup(cfg.model, cfg.num_classes, cfg.image_size, cfg.global_batch_size, cfg.seed)
    rounds: dict[str, list[list[float]]] = {}  # "side schedule m" -> per round, the step seconds

    def add(side: str, run: dict[str, Any], figure: str) -> None:
        rounds.setdefault(f"{side} {run['schedule']} m={run['microbatches']}", []).append(run["samples"][figure])

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for _ in range(args.rounds):
            ours = layout_runs(cfg, model, x, y, cfg.split_points, cfg.microbatches)
            for run in ours["runs"]:
                for side, figure in SIDES.items():
                    add(side, run, figure)
            for run in native_resnet(cfg, ours["plan"])["runs"]:
                add("torch", run, "step_seconds")
    finally:
        ray.shutdown()

    def pooled(key: str) -> float:
        return statistics.median(t for samples in rounds[key] for t in samples)

    result = {}
    for schedule in ("gpipe", "1f1b"):
        for m in cfg.microbatches:
            point = f"{schedule} m={m}"
            if f"torch {point}" not in rounds:  # a point the schedule refuses (1F1B with m < 2)
                continue
            figures = {side: pooled(f"{side} {point}") for side in ("torch", *SIDES)}
            result[point] = {
                **figures,
                **{f"torch/{side}": figures["torch"] / figures[side] for side in SIDES},
                "by_round": {side: [statistics.median(r) for r in rounds[f"{side} {point}"]] for side in ("torch", *SIDES)},
                "steps_per_side": sum(len(r) for r in rounds[f"ours {point}"]),
            }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
