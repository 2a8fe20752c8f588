"""The one-process references (``one_process``) of ``raytrain-mp bench pipeline``
(``results["one_process"]``).

Job: time one process with ``--threads`` torch threads (on GPU 0 with ``--use-gpu``), the whole
batch at once, and the same process with gradient accumulation over every m > 1 of the sweep: on
a CPU a smaller micro-batch is itself faster per sample (caches), so this separates that gain from
the gain of overlapping stages.

Invariants:
- Gradient accumulation computes what a pipelined step distributes over the stages: each
  micro-batch's loss weighted by its share of the batch, one optimizer step.
- It runs in a child process (``bench.common.in_fresh_process``) that exits before the pipelines
  start: it sets torch's threads, and on a GPU its CUDA context and cached memory leave GPU 0.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raytrain_mp.bench.common import summarize, timed
from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline.shared import progress, sgd
from raytrain_mp.pipeline import split_batch


def accumulation_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, m: int) -> None:
    """One optimizer step over the batch as m micro-batches, each loss weighted by its share: the
    computation a pipelined step distributes over the stages (m=1: the plain full-batch step)."""
    for mb in split_batch(x, y, m):
        (F.cross_entropy(model(mb.inputs), mb.targets, reduction="sum") / len(x)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()


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
