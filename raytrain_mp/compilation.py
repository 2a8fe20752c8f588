"""``torch.compile`` as every command runs it: the driver's probe, the node's compile cache, the
compiler a worker applies, and the lines that say what compiling cost and whether it paid.

Job: ``check_compiler`` compiles one op on the driver before any worker starts, so that a torch or
a machine that cannot compile (no C++ compiler for inductor's CPU code) is one ``--compile`` line,
never a worker's stack trace. ``compiler`` points this process's inductor caches at the node's
``--compile-cache`` folder and returns what compiles a module. ``CompileWatch`` counts the graphs a
first step compiled and read from that cache, for the line a run prints after it.

Choices, measured in docs/performance.md ("Compiled training"):
- What is compiled is the module a rank computes with, not its wrapper: DDP wraps the compiled
  model (``ddp.execution``), a pipeline stage's actor compiles its stage (as torchtitan compiles
  per block). The model's own modules stay what the state dicts, the optimizer and the weight
  average hold: compiling changes no key. A DDP rank first compiles a copy outside DDP (the
  memory-format trial, which also times eager against compiled), so the run's graph is the whole
  model's and a restart reads it from the cache; the gradients' all-reduce then starts after the
  compiled backward, not during it. The alternative a torchrun script takes,
  ``torch.compile(DDP(model))`` (dynamo's DDPOptimizer cuts the graph at DDP's gradient buckets
  so that their all-reduce overlaps the backward), is ``bench ddp --compile``'s peer.
- The portable SyncBatchNorm is traced whole (``ddp.sync_batchnorm``): ResNet-18 compiles into
  one graph, no break (``torch._dynamo.explain``; each layer's ``Tensor.item()`` broke it 20
  times before). On CUDA the native layer runs.
- DDP evaluates through the compiled model (one more graph, eval mode, also cached); a pipeline
  stage's eval forwards (its shape probe, ``predict``) run eager; ``eval`` and ``predict``
  compile their eval-mode model.
- The cache is inductor's own (the FX graph and AOTAutograd caches, Triton's kernels under
  ``TORCHINDUCTOR_CACHE_DIR``), in a node-local folder that outlives every process of a run, so
  a ``--max-failures`` restart, an elastic resize, a rerun of a ``--name`` and the trials after a
  sweep's first read compiled graphs instead of compiling them; inductor's keys cover the graph,
  its inputs' shapes and dtypes, torch's version and its config, so one folder serves every run.

Invariants: compiling changes the speed, not the model: values agree with eager ones up to the
order of floating point sums inside fused kernels (tests: fp64 DDP and pipeline runs, 1e-9); a
probe that passes holds for the process (memoized per mode).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrain_mp.compile_options import DEFAULT_CACHE
from raytrain_mp.errors import UsageError
from raytrain_mp.faults import first_line

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_cache(folder: str | None) -> str:
    """Point this process's inductor caches at ``folder`` (else the node's ``TORCHINDUCTOR_CACHE_DIR``,
    else ``DEFAULT_CACHE``), made absolute on this node; returns it. Before the process's first compile."""
    path = Path(folder or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    # Inductor's C++ builder imports cpp_extension, which warns on every CPU-only machine that it
    # found no CUDA runtime: a line in every compiling process's output that says nothing to a user.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    return str(path)


def check_compiler(options: Any) -> None:
    """Raise a one-line ``UsageError`` when ``options.compile`` is on and torch cannot compile here:
    a one-op graph compiled with the run's mode, bypassing the cache (a cached probe would pass on
    a machine that cannot compile the model's graphs)."""
    if options.compile:
        _probe(options.compile_mode, options.compile_cache)


@functools.cache
def _probe(mode: str, cache: str | None) -> None:
    if not torch._dynamo.is_dynamo_supported():
        raise UsageError(
            f"--compile: torch {torch.__version__} cannot compile on this platform; accepted: --no-compile"
        )
    use_cache(cache)
    import torch._inductor.config as inductor_config

    try:
        with inductor_config.patch(fx_graph_cache=False):
            torch.compile(_one_op, mode=mode, fullgraph=True)(torch.ones(2))
    except Exception as exc:  # noqa: BLE001 (whatever stops inductor is the line the user needs)
        reason = first_line(str(exc)).removeprefix("InvalidCxxCompiler: ")
        raise UsageError(
            f"--compile: torch {torch.__version__} cannot compile here ({reason}); accepted: --no-compile, "
            "or a C++ compiler inductor can run (set CXX)"
        ) from None
    finally:
        torch._dynamo.reset()


def _one_op(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def compiler(options: Any) -> Callable[[nn.Module], Callable] | None:
    """What compiles a module under ``options`` (``--compile``, its mode, this node's cache), or
    None when the run is eager."""
    if not options.compile:
        return None
    use_cache(options.compile_cache)
    return functools.partial(torch.compile, mode=options.compile_mode)


def _cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]


@dataclass
class CompileWatch:
    """The FX graph cache's hits and misses of this process since ``start``, and the seconds: what
    a trial and a first step read from the cache, compiled, and took."""

    hits: int = 0
    misses: int = 0
    started: float = 0.0

    @classmethod
    def start(cls) -> CompileWatch:
        return cls(*_cache_counts(), time.perf_counter())

    def since(self) -> tuple[int, int]:
        """(graphs read from the cache, graphs compiled) since ``start``."""
        hits, misses = _cache_counts()
        return hits - self.hits, misses - self.misses

    def counts(self) -> tuple[int, int, float, str]:
        """(graphs read from the cache, graphs compiled, seconds) since ``start``, and the cache's folder."""
        hits, misses = self.since()
        return hits, misses, time.perf_counter() - self.started, os.environ[CACHE_ENV]

    def line(self) -> str:
        """What compiling took so far, for the line after a start's first step."""
        return compiled_line([self.counts()])


def compiled_line(counts: Sequence[tuple[int, int, float, str]]) -> str:
    """The line of one process's ``CompileWatch.counts``, or of several that compiled side by side
    (a pipeline's stage actors: their graphs summed, the slowest one's seconds)."""
    hits, total = sum(c[0] for c in counts), sum(c[0] + c[1] for c in counts)
    folders = ", ".join(dict.fromkeys(c[3] for c in counts))
    return f"compiled in {max(c[2] for c in counts):.1f} s: {hits} of {total} graphs from the cache {folders}"


def slower_note(eager: float, compiled: float) -> str | None:
    """The ``note:`` a compiled run prints where its forward+backward is slower than eager's."""
    if compiled <= eager:
        return None
    return (
        f"--compile: a forward and backward take {compiled * 1e3:.0f} ms compiled, {eager * 1e3:.0f} ms eager "
        f"at these shapes ({eager / compiled:.2f}x): --no-compile trains faster here"
    )
