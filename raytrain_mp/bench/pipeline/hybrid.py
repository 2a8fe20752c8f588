"""The hybrid case of ``raytrain-mp bench pipeline`` (``--hybrid``, on by default;
``results["hybrid"]``, ``summary.hybrid_seconds``): data x pipeline.

Job: for k = ``--hybrid-workers`` stage actors, time every layout of R replicas x S stages with
R x S = k, from pure data parallel (R=k, S=1) to pure pipeline (R=1, S=k), on the same model and
global batch as the ResNet figures, GPipe over R x m = ``--hybrid-microbatches`` micro-batches;
stages cut by parameter count; GPU stages where the cluster has GPUs.

Invariants: every layout computes the same step (the same global batch in the same number of
micro-batches); each layout's stages start once and are timed by ``timing.sweep_runs``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline.shared import LR, MOMENTUM, Sweep
from raytrain_mp.bench.pipeline.timing import sweep_runs
from raytrain_mp.pipeline import PipelineTrainer


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
            model,
            stages,
            balance="params",
            num_replicas=replicas,
            num_microbatches=m,
            lr=LR,
            momentum=MOMENTUM,
            weight_decay=0.0,
            cpus_per_stage=cfg.cpus_per_stage,
            use_gpu=cfg.use_gpu,
            memory_format=cfg.memory_format,
        ) as trainer:
            sweep = Sweep(f"hybrid R={replicas} x S={stages} ", "s", ("gpipe",), (m,), cfg.warmup, cfg.steps)
            (run,), _ = sweep_runs(trainer, x, y, sweep)
            nodes = len(set(trainer.nodes))
        samples = cfg.global_batch_size / run["step_seconds"]["median"]
        runs.append({"replicas": replicas, "stages": stages, "nodes": nodes, "samples_per_second": samples, **run})
    return {"workers": cfg.hybrid_workers, "microbatches": total, "runs": runs}


def hybrid_seconds(hybrid: dict[str, Any]) -> dict[str, float]:
    """``summary.hybrid_seconds``: median step seconds per layout, keyed ``R{replicas}xS{stages}``."""
    return {f"R{run['replicas']}xS{run['stages']}": run["step_seconds"]["median"] for run in hybrid["runs"]}
