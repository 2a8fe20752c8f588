"""Where an overhead-bound pipeline step's time goes: our stage code against torch's own loop, in
torchrun processes and in Ray actors, side by side.

    python scripts/pipeline_step_split.py [--schedule gpipe] [--microbatches 8] [--rounds 6]

``bench pipeline`` compares the whole of ours (Ray actors, a Ray call per K steps) with torch's
runtime under torchrun; this splits that ratio in two. The same two ranks run, in alternating
blocks of ``BLOCK`` steps, ``StageWorker.train_step`` (ours) and a plain loop of torch's
``schedule.step`` + SGD (torch), on ``bench pipeline``'s overhead MLP cut in two: first as two
torchrun processes, then as two Ray actors (at niceness 0, as our stage actors run) on a local Ray
of 2 CPUs without a dashboard. No Ray calls are timed in either: each block runs inside the ranks.
Prints one JSON object: per place (torchrun, ray_actors) and loop, the median (min-max) of the
rounds' milliseconds per step, and the two ratios torch / ours that separate the stage code from
the process it runs in. Milliseconds on a shared machine drift; read the ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from raytrain_mp.bench.pipeline import LR, MOMENTUM, even_cut, seeded_mlp, sgd, stage_modules
from raytrain_mp.pipeline.schedule import SCHEDULES
from raytrain_mp.pipeline.stage import StageConfig, StageWorker, run_at_normal_niceness

BLOCK = 40  # steps a timed block
BATCH, LAYERS = 64, 4  # bench pipeline's overhead case with its interleaved schedules on


def measure(schedule: str, m: int, rounds: int) -> dict[str, list[float]] | None:
    """On the joined 2-rank group: milliseconds per step of each round's block, per loop (on rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, x, y = seeded_mlp(LAYERS, BATCH, seed=0)
    _, blocks = even_cut(model, world)
    config = StageConfig(rank=rank, num_ranks=world, lr=LR, momentum=MOMENTUM)
    ours = StageWorker([stage_modules(copy.deepcopy(model), blocks)[rank]], config)
    chunk = stage_modules(model, blocks)[rank].train()
    optimizer = sgd(chunk)
    theirs = SCHEDULES[schedule].torch_class()(
        PipelineStage(chunk, rank, world, torch.device("cpu")), m, loss_fn=F.cross_entropy
    )

    def our_step() -> None:
        ours.train_step(
            SCHEDULES[schedule],
            m,
            (BATCH // m, *x.shape[1:]),
            x if rank == 0 else None,
            y if rank == world - 1 else None,
        )

    def their_step() -> None:
        theirs.step(x) if rank == 0 else theirs.step(target=y, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def block(step: Any, steps: int = BLOCK) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        return (time.perf_counter() - start) / steps * 1000

    loops = {"ours": our_step, "torch": their_step}
    for step in loops.values():
        block(step, 5)  # warm-up: shapes, buffers, gloo pairs
    figures: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, step in loops.items():
            figures[name].append(block(step))
    return figures if rank == 0 else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def under_torchrun(args: argparse.Namespace) -> dict[str, list[float]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--schedule", args.schedule, "--microbatches", str(args.microbatches),
               "--rounds", str(args.rounds)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def in_ray_actors(args: argparse.Namespace) -> dict[str, list[float]]:
    import ray

    @ray.remote(num_cpus=1)
    class Rank:
        def __init__(self) -> None:
            run_at_normal_niceness()

        def run(self, rank: int, port: int) -> dict[str, list[float]] | None:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            try:
                return measure(args.schedule, args.microbatches, args.rounds)
            finally:
                dist.destroy_process_group()

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a stale `ray start`
    try:
        port = free_port()
        return ray.get([actor.run.remote(rank, port) for rank, actor in enumerate([Rank.remote(), Rank.remote()])])[0]
    finally:
        ray.shutdown()


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if "RANK" in os.environ:  # a torchrun rank of under_torchrun
        dist.init_process_group("gloo")
        figures = measure(args.schedule, args.microbatches, args.rounds)
        if figures is not None:
            print(json.dumps(figures))
        dist.destroy_process_group()
        return
    places = {"torchrun": under_torchrun(args), "ray_actors": in_ray_actors(args)}
    median = {place: {loop: statistics.median(ms) for loop, ms in loops.items()} for place, loops in places.items()}
    print(
        json.dumps(
            {
                "schedule": args.schedule,
                "microbatches": args.microbatches,
                "rounds": args.rounds,
                "steps_a_block": BLOCK,
                "ms_per_step": {
                    place: {loop: spread(ms) for loop, ms in loops.items()} for place, loops in places.items()
                },
                "torch_over_ours_same_process": {place: m["torch"] / m["ours"] for place, m in median.items()},
                "torchrun_over_ray_actors_same_code": {
                    loop: median["torchrun"][loop] / median["ray_actors"][loop] for loop in ("ours", "torch")
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
