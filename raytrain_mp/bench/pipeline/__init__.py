"""``raytrain-mp bench pipeline``: one process vs naive model parallel vs our pipelined schedules
vs PyTorch's own ``torch.distributed.pipelining``, and ours vs native where only the pipeline
machinery costs time.

Job: time one training step (forward, backward, SGD step) of the same model on the same random
in-memory batch in each of these ways, and write ``results.json`` plus two plots (three with the
overhead case). ``run_bench_pipeline`` runs the cases in this order, one module each:

- ``references``: one process with ``--threads`` torch threads, the whole batch and gradient
  accumulation over m micro-batches;
- ``layouts``: ``PipelineTrainer`` on one partition: the fixed layer3 split, time-balanced stages
  (``--balanced``) and interleaved stages (``--interleaved``);
- ``native``: the native peer (``bench.pipeline_native`` under torchrun) and the layer3 split, ours
  then native, in ``--resnet-rounds`` rounds;
- ``overhead``: ours against native on a seeded MLP whose compute is negligible (``--overhead``);
- ``hybrid``: data x pipeline, every R replicas x S stages layout of ``--hybrid-workers`` actors
  (``--hybrid``);

and ``report`` turns their figures into ``summary`` and the plots. ``shared`` holds what the cases
share (the seeded model and batch, the optimizer, the sweep, progress lines, pooling rounds), and
``timing`` the timing of a sweep on running stages, which every case of ours goes through.

Devices: ``--use-gpu`` (the default where this machine has a GPU for each stage) puts every stage
actor and native rank on its own GPU (NCCL between them) and the references on GPU 0; with fewer
GPUs than stages it is one error line before anything runs. The references run in a child process
that exits before the pipelines start, so their CUDA context and cached memory leave GPU 0.

Invariants:
- Every step time is the median of ``--steps`` timed steps after ``--warmup`` untimed ones (of
  the rounds' steps pooled where a case runs in rounds), with min and max (``bench.common``);
  every variant starts from the same seeded model and batch (``shared.seeded_setup``).
- The cases run one after the other, never side by side (a case's stages shut down before the
  next case starts), and return their figures; only ``run_bench_pipeline`` writes, the plots and
  then ``results.json`` (atomically, ``bench.common.write_results``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from raytrain_mp.bench.common import bench_use_gpu, in_fresh_process, machine, write_results
from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline.hybrid import hybrid_runs, hybrid_seconds
from raytrain_mp.bench.pipeline.layouts import layout_runs
from raytrain_mp.bench.pipeline.native import layer3_split_rounds, native_runs, resnet_case
from raytrain_mp.bench.pipeline.overhead import overhead_ratios, overhead_rounds, overhead_section
from raytrain_mp.bench.pipeline.references import one_process
from raytrain_mp.bench.pipeline.report import best_run, plot_bars, plot_m_curve, plot_overhead, summary
from raytrain_mp.bench.pipeline.shared import (
    INTERLEAVED_VIRTUAL,
    LR,
    MOMENTUM,
    even_cut,
    seeded_mlp,
    seeded_setup,
    sgd,
    stage_modules,
)
from raytrain_mp.errors import UsageError

# The entry point, and what the scripts (pipeline_timeline, pipeline_step_split, pipeline_cut_bubbles) use.
__all__ = [
    "LR",
    "MOMENTUM",
    "even_cut",
    "layout_runs",
    "native_runs",
    "resnet_case",
    "run_bench_pipeline",
    "seeded_mlp",
    "seeded_setup",
    "sgd",
    "stage_modules",
]


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
    fixed, natives = layer3_split_rounds(cfg, model, x, y)
    native, native_ours_layouts = natives["native"], natives.get("native_ours_layouts")
    layouts = {"fixed": fixed}
    overhead = overhead_rounds(cfg) if cfg.overhead else None
    hybrid = hybrid_runs(cfg, model, x, y) if cfg.hybrid else None
    if cfg.balanced:
        layouts["balanced"] = layout_runs(cfg, model, x, y, None, sorted(cfg.microbatches), schedules=("gpipe",))
    if cfg.interleaved:
        layouts["interleaved"] = layout_runs(
            cfg,
            model,
            x,
            y,
            None,
            sorted(cfg.microbatches),
            schedules=("interleaved-1f1b",),
            virtual=INTERLEAVED_VIRTUAL,
        )

    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plots = [out / "step_time_bars.png", out / "m_curve.png"]
    plot_bars(plots[0], local, layouts, best_run(layouts), native)
    plot_m_curve(plots[1], cfg, local, layouts, native, native_ours_layouts)
    results: dict[str, Any] = {
        "benchmark": "pipeline",
        "machine": host,
        "settings": {
            k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("json", "address", "out", "verbose")
        },
        "one_process": local,
        "layouts": layouts,
        **natives,
        "summary": summary(local, layouts, native, native_ours_layouts),
    }
    if overhead is not None:
        results["overhead"] = overhead_section(cfg, *overhead)
        results["summary"]["overhead_native_over_ours"] = overhead_ratios(results["overhead"])
        results["summary"]["overhead_native_over_ours_queued"] = overhead_ratios(
            results["overhead"], "native_over_ours_queued"
        )
        plots.append(out / "overhead.png")
        plot_overhead(plots[-1], cfg, results["overhead"])
    if hybrid is not None:
        results["hybrid"] = hybrid
        results["summary"]["hybrid_seconds"] = hybrid_seconds(hybrid)
    results["elapsed_seconds"] = time.perf_counter() - started
    path = write_results(out, results)
    return {"results": str(path), "plots": [str(plot) for plot in plots], **results["summary"]}
