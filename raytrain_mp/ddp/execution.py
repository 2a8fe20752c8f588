"""How a DDP rank's model computes: its memory format (``--memory-format``) and compiled or eager
(``--compile``), decided once per run.

Job: ``prepare_runner`` returns what DDP wraps (the model in its layout, compiled under
``--compile``; ``memory_format.layout_runner``, ``compilation.compiler``) and what rank 0 says about
it. ``auto`` times a copy of the model in both layouts on one micro-batch of the run's shape, as
the run computes (compiled under ``--compile``), and keeps the faster; under ``--compile`` the
chosen layout is also timed eager, and a run whose compiled forward+backward is the slower says so
in one ``note:`` line.

Invariants:
- The layout is the run's, not a start's: rank 0's measurement is broadcast, and a checkpoint
  carries it (``train_state["memory_format"]``), so a restarted or resized group computes in the
  layout the run started with.
- Every rank runs the trial's passes (its SyncBatchNorm layers all-gather in each forward); only
  rank 0's seconds count.
- The model keeps its parameters, converted in place: state-dict keys, the optimizer and the weight
  average see the plain model; only the speed and the order of floating point sums change.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from raytrain_mp.compilation import CompileWatch, compiler, slower_note
from raytrain_mp.config import LAYOUTS
from raytrain_mp.memory_format import layout_runner, layout_seconds
from raytrain_mp.precision import Autocast, autocast_for


@dataclass
class Execution:
    """The layout a run computes in, rank 0's lines about it, and (compiled) the cache's counts."""

    layout: str
    lines: list[str] = field(default_factory=list)
    watch: CompileWatch | None = None  # the compile cache's counts since the trial began


def prepare_runner(
    cfg, model: nn.Module, sample_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, carried: str | None
) -> tuple[nn.Module, Execution]:
    """(what DDP wraps, how it runs) for ``model`` under ``cfg``; ``carried`` is the layout a
    checkpoint of the run holds (None on a first start). Under ``--precision`` bf16 or fp16 the
    runner holds its autocast (``precision.Autocast``): the trial times what the run computes, and
    the graph it compiles is the run's."""
    compile = compiler(cfg)
    autocast = autocast_for(cfg.precision, device) if cfg.precision in ("bf16", "fp16") else None
    wrap = (lambda module: Autocast(module, autocast)) if autocast else (lambda module: module)
    watch = CompileWatch.start() if compile is not None else None
    layout = carried or (cfg.memory_format if cfg.memory_format != "auto" else None)
    execution = Execution(layout or "contiguous", watch=watch)
    if layout is None or compile is not None:  # auto's choice, or the compiled/eager note
        sample = torch.randn(sample_shape, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)
        seconds = _rank_zeros(
            layout_seconds(model, sample, False, wrap, compile, layouts=(layout,) if layout else LAYOUTS)
        )
        if seconds:
            execution.layout = layout or min(seconds, key=seconds.__getitem__)
            if layout is None:
                execution.lines.append(f"memory format: {execution.layout} ({_timings(seconds)})")
            if compile is not None:
                eager = _rank_zeros(layout_seconds(model, sample, False, wrap, layouts=(execution.layout,)))
                note = slower_note(eager[execution.layout], seconds[execution.layout])
                execution.lines += [f"note: {note}"] if note else []
    if compile is None:
        return layout_runner(wrap(model), execution.layout), execution
    # A compiled backward may give a 1x1 kernel's gradient other strides for its size-1 dims than
    # the parameter's (the same elements in the same order); DDP then warns once per rank, and
    # copies it into its bucket, as it copies every gradient unless gradient_as_bucket_view.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    return layout_runner(wrap(model), execution.layout, compile), execution


def _rank_zeros(seconds: dict[str, float]) -> dict[str, float]:
    """Rank 0's ``seconds``, on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [seconds]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return seconds


def _timings(seconds: dict[str, float]) -> str:
    return ", ".join(f"{layout} {s * 1e3:.0f} ms" for layout, s in seconds.items()) + " a forward and backward"
