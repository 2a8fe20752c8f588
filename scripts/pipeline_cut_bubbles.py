"""What each cut costs once its stages run: busy seconds per stage and the bubble of GPipe, for
several split points of the same model, in alternating rounds.

    python scripts/pipeline_cut_bubbles.py [--split-points layer3,layer3.0.conv2,layer3.0.conv3,layer3.1]
                                           [--microbatches 8] [--rounds 2] [--steps 4]

``bench pipeline``'s balanced layout takes the cut the profile (``partition.profile_blocks``)
picks; this measures the cuts around it on ``bench pipeline``'s ResNet-50 setup (128x128, batch
64, 2 stages of 1 CPU, a local Ray of 2 CPUs without a dashboard), so that the profile's choice
can be checked against what the running stages do. Every round runs every split point in turn
(a ``PipelineTrainer`` each, one warm-up step, then ``--steps`` timed ones), so a shared machine's
drift falls on all of them. Prints one JSON object: per split point, the per-round medians of
each stage's busy seconds and forward busy seconds, of the bubble fraction, of the step's wall
seconds, and the bubble a perfect runtime would show with those busy times
(``schedule.bubble_for_stage_times``, GPipe's phases apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import ray

from raytrain_mp.bench.pipeline import LR, MOMENTUM, seeded_setup
from raytrain_mp.pipeline import PipelineTrainer
from raytrain_mp.pipeline.schedule import bubble_for_stage_times, ideal_bubble


def measure(model: Any, x: Any, y: Any, point: str, m: int, steps: int) -> dict[str, Any]:
    """GPipe over m micro-batches on the cut before ``point``: medians of ``steps`` steps."""
    with PipelineTrainer(
        model,
        2,
        split_points=[point],
        num_microbatches=m,
        schedule="gpipe",
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=0.0,
        use_gpu=False,
    ) as trainer:
        trainer.train_step(x, y)  # warm-up
        trainer.stats(reset=True)
        stats = []
        for _ in range(steps):
            trainer.train_step(x, y)
            stats.append(trainer.stats(reset=True))
    busy = [statistics.median(s.busy_seconds[stage] for s in stats) for stage in range(2)]
    forward = [statistics.median(s.forward_busy_seconds[stage] for s in stats) for stage in range(2)]
    return {
        "busy_seconds": busy,
        "forward_busy_seconds": forward,
        "bubble_fraction": statistics.median(s.bubble_fraction for s in stats),
        "wall_seconds": statistics.median(s.wall_seconds for s in stats),
        "bubble_for_stage_times": bubble_for_stage_times(busy, m, forward),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-points", default="layer3,layer3.0.conv2,layer3.0.conv3,layer3.1")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    points = args.split_points.split(",")
    model, x, y = seeded_setup("resnet50", 1000, 128, 64, 0)
    rounds: dict[str, list[dict[str, Any]]] = {point: [] for point in points}
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        for _ in range(args.rounds):
            for point in points:
                rounds[point].append(measure(model, x, y, point, args.microbatches, args.steps))
    finally:
        ray.shutdown()
    result = {
        "microbatches": args.microbatches,
        "bubble_formula": ideal_bubble("gpipe", 2, args.microbatches),
        "cuts": {point: {key: [r[key] for r in runs] for key in runs[0]} for point, runs in rounds.items()},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
