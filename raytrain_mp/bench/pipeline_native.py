"""The native side of ``raytrain-mp bench pipeline``: PyTorch's own ``torch.distributed.pipelining``.

Job: join the process group torchrun describes (NCCL with one GPU per rank when the settings'
``use_gpu`` says so, gloo on CPUs otherwise) and, for each case of the settings in turn (``resnet``:
the layer3-split layout's stages, ``bench.pipeline.native.resnet_case``; ``overhead``: the tiny MLP
of the overhead case, ``bench.pipeline.overhead.overhead_case``), build the same seeded model and
batch as ``bench.pipeline`` (``bench.pipeline.shared``; the case names ``seeded_setup`` or
``seeded_mlp`` and its arguments), take this rank's stage of the case's block names
(``stage_modules``), wrap it in ``PipelineStage`` and time one training step (``schedule.step``,
then SGD with ``bench.pipeline``'s lr and momentum) under ``ScheduleGPipe``, ``Schedule1F1B`` and,
with the model cut into ranks x 2 chunks of which rank r holds r and r + ranks,
``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``, for every (schedule, m) of the
case's sweep; rank 0 writes the figures of every case as JSON (each run's timed steps under
``samples``, so that rounds can be pooled). Run as ``python -m torch.distributed.run --standalone
--nproc-per-node STAGES -m raytrain_mp.bench.pipeline_native --settings JSON --result PATH``
(``bench.common.torchrun``).

Invariants:
- Rank r runs stage r (chunks r, r + ranks, ... with virtual stages, torch's interleaved layout).
  Every rank builds the same weights and batch (same seed), so rank 0's inputs and the last rank's
  targets are the batch our pipeline trains on.
- The loss is cross entropy averaged over each micro-batch and the schedule divides gradients by
  m (``scale_grads=True``): the gradient of the batch mean, as our stages compute it.
- A step ends with ``dist.barrier()``, so every rank's timed step spans the whole pipeline step;
  rank 0's times are reported (``bench.common.timed``: ``warmup`` untimed steps, then ``steps``).
- Where the case's ``steps_per_call`` K > 1, the steps are also timed back to back in groups of K
  with one barrier a group (``queued_step_seconds``: a group's seconds / K, one untimed group
  first, ``steps`` rounded up to whole groups): the way ours' queued figure times K steps a Ray
  call, so both are means over K steps and their medians compare. (They are not the same
  statistic as a median of single steps, which drops the slowest steps where a mean over K keeps
  them; docs/performance.md, the overhead-bound case, has how far apart they came out.)
- Each (schedule, m) gets a fresh ``PipelineStage``: the stage infers its shapes from the first
  micro-batch of its first step (a real forward and backward, which warm-up absorbs). The model
  and optimizer state carry over, as they do across our trainer's sweep.
- A (schedule, m) the API refuses (1F1B with m < stages) or cannot run (m not dividing the batch:
  receive buffers are sized from one micro-batch) is skipped with the reason, on every rank alike,
  so no rank waits on a peer that skipped.
- The cases run one after the other in one torchrun and share nothing but the process group and
  the thread count: each builds its own model, optimizer and stages.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from raytrain_mp.bench.common import join_torchrun_group, summarize, timed
from raytrain_mp.bench.pipeline.shared import seeded_mlp, seeded_setup, sgd, stage_modules, virtual_stages
from raytrain_mp.memory_format import layout_runner
from raytrain_mp.pipeline.schedule import SCHEDULES, stage_indices

SETUPS = {"seeded_setup": seeded_setup, "seeded_mlp": seeded_mlp}


def uneven(batch_size: int, m: int) -> str | None:
    """Why m micro-batches cannot run natively, or None: PipelineStage sizes its buffers once."""
    if batch_size % m:
        return (
            f"{m} micro-batches of a batch of {batch_size} differ in size; PipelineStage sizes its "
            "receive buffers from the first micro-batch"
        )
    return None


def measure(case: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Time every (schedule, m) of one case of the settings on this rank's stage; this rank's
    figures."""
    model, x, y = SETUPS[case["setup"]](**case["arguments"])
    if case.get("compile"):  # as ours (pipeline.stage): torch's runtime splits a backward over a retained graph
        torch._functorch.config.donated_buffer = False
    x, y = x.to(device), y.to(device)
    # per virtual-stage count: this rank's chunks (torch's loop layout: r, r + world, ...) and their optimizer
    held = {}
    for virtual, chunk_blocks in case["chunk_blocks"].items():
        indices, every = stage_indices(rank, world, int(virtual), "loop"), stage_modules(model, chunk_blocks)
        chunks = [every[i].to(device).train() for i in indices]
        held[int(virtual)] = (indices, chunks, sgd(nn.ModuleList(chunks)))
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for name in case["schedules"]:
        virtual = virtual_stages(name)
        indices, chunks, optimizer = held[virtual]
        for m in case["microbatches"]:
            reason = uneven(len(x), m)
            if reason is None:
                # in the layouts ours computed this point in, where the case names them
                layouts = case.get("layouts", {}).get(f"{name} {m}", [["contiguous"] * virtual] * world)[rank]
                compile = torch.compile if case.get("compile") else None
                runners = [layout_runner(chunk, layout, compile) for chunk, layout in zip(chunks, layouts)]
                stages = [
                    PipelineStage(runner, index, world * virtual, device) for index, runner in zip(indices, runners)
                ]
                try:
                    entry = SCHEDULES[name]
                    schedule = entry.torch_class()(
                        stages if entry.multi_stage else stages[0], m, loss_fn=F.cross_entropy
                    )
                except ValueError as exc:  # the schedule's own check, e.g. 1F1B with m < stages
                    reason = " ".join(str(exc).split())
            if reason is not None:
                skipped.append({"schedule": name, "microbatches": m, "reason": reason})
                continue

            def steps(count: int, schedule: Any = schedule) -> None:
                for _ in range(count):
                    if rank == 0:
                        schedule.step(x)
                    elif rank == world - 1:
                        schedule.step(target=y, return_outputs=False)
                    else:
                        schedule.step()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()

            samples = {"step_seconds": timed(lambda: steps(1), case["warmup"], case["steps"])}
            per_call = case["steps_per_call"]
            if per_call > 1:
                calls = -(-case["steps"] // per_call)
                samples["queued_step_seconds"] = [t / per_call for t in timed(lambda: steps(per_call), 1, calls)]
            figures = {figure: summarize(values) for figure, values in samples.items()}
            runs.append({"schedule": name, "microbatches": m, **figures, "samples": samples})
    return {"runs": runs, "skipped": skipped}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings", required=True, help="threads, use_gpu and cases (bench.pipeline.native_runs) as JSON"
    )
    parser.add_argument("--result", required=True, help="where rank 0 writes its figures")
    args = parser.parse_args(argv)
    settings = json.loads(args.settings)
    device = join_torchrun_group(settings["use_gpu"])
    world = dist.get_world_size()
    torch.set_num_threads(settings["threads"])  # torchrun sets OMP_NUM_THREADS; torch's pool is ours
    cases = {
        name: measure(case, dist.get_rank(), dist.get_world_size(), device) for name, case in settings["cases"].items()
    }
    if dist.get_rank() == 0:
        placed = {"backend": dist.get_backend(), "device": device.type, "world": world, "threads": settings["threads"]}
        Path(args.result).write_text(json.dumps({**placed, "cases": cases}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
