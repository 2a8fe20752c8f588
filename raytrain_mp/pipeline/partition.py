"""Cut an ordered list of blocks into contiguous pipeline stages.

Job: decide which blocks each stage holds — from explicit split points, from per-block costs
(parameter counts, or forward+backward seconds measured by ``profile_blocks``) — and report
each stage's cost and parameter share. Pure: no Ray; profiling needs only torch.

A partition is given by ``bounds``: ``num_stages + 1`` increasing block indices from 0 to the
number of blocks; stage ``s`` holds blocks ``bounds[s]:bounds[s + 1]``.

Invariants:
- Every stage holds at least one block; the stages cover the blocks in order.
- ``balance_bounds`` never leaves a stage with a negligible share (cost below ``negligible`` times
  the total, 1% by default) when a cut without one costs at most that much more on the bottleneck
  (the largest stage cost). Its bottleneck is exact up to that allowance: at most the smallest
  possible one plus ``negligible`` times the total, and exactly the smallest possible one unless
  exceeding it is what avoids a negligible stage (never with ``negligible=0``). The smallest
  possible bottleneck can force a tiny block into a stage of its own (ResNet-18's head, 0.7% of
  the time, after a layer4.1 that is a third of it); joining it to its neighbour costs its own
  share on the bottleneck, less than the noise of the measurement.
- The cut is unique: among cuts with the chosen bottleneck, the one with the largest smallest
  stage; among those, the one whose cut points, compared from the last, are smallest (later
  stages take as many blocks as they can). Exact dynamic programmes, no floating tolerance.
- Bad input raises a one-line ``UsageError`` naming the option, before any resource is used.

Profiling measures what a stage costs once it has run for a while: the profiling task keeps
freed memory (``allocator.keep_freed_memory``), as the stage actors do, so that blocks profiled
one after another in a fresh process do not pay the page faults a running stage does not.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import accumulate
from math import inf

import torch
from torch import Tensor, nn

from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline.blocks import Block, Carry

BALANCE_MODES = ("time", "params")
NEGLIGIBLE_SHARE = 0.01  # a stage with less than this share of the total cost is negligible


@dataclass(frozen=True)
class StagePlan:
    """What one stage holds and what it costs."""

    index: int
    blocks: tuple[str, ...]
    params: int
    param_share: float
    seconds: float | None  # measured forward+backward seconds per micro-batch; None if not profiled


def check_stage_count(num_blocks: int, num_stages: int) -> None:
    if num_stages < 1:
        raise UsageError(f"num_stages: need at least 1 stage, got {num_stages}")
    if num_stages > num_blocks:
        raise UsageError(
            f"num_stages: {num_stages} stages for {num_blocks} blocks; each stage needs at least one block"
        )


def split_bounds(block_names: Sequence[str], split_points: Sequence[str], num_stages: int) -> list[int]:
    """Bounds that cut before each split point.

    A split point names a block (``"layer3.0"``) or a group of blocks by prefix (``"layer3"``
    cuts before its first block, the seeds' ``seq1``/``seq2`` split).
    """
    check_stage_count(len(block_names), num_stages)
    if len(split_points) != num_stages - 1:
        raise UsageError(
            f"split_points: {num_stages} stages need {num_stages - 1} split point(s), got {len(split_points)}"
        )
    bounds = [0]
    for point in split_points:
        start = _first_block(block_names, point)
        if start == 0:
            raise UsageError(f"split_points: cutting before {point!r} would leave stage 0 empty")
        if start <= bounds[-1]:
            raise UsageError(
                f"split_points: {point!r} does not come after {block_names[bounds[-1]]!r}; "
                "give split points in model order"
            )
        bounds.append(start)
    return bounds + [len(block_names)]


def _first_block(block_names: Sequence[str], point: str) -> int:
    for index, name in enumerate(block_names):
        if name == point or name.startswith(f"{point}."):
            return index
    raise UsageError(f"split_points: {point!r} names no block; blocks: {', '.join(block_names)}")


def balance_bounds(costs: Sequence[float], num_stages: int, negligible: float = NEGLIGIBLE_SHARE) -> list[int]:
    """Contiguous bounds minimizing the largest stage cost, without negligible stages where it is cheap.

    Costs are non-negative. Let ``floor = negligible * sum(costs)`` and ``best`` the smallest
    possible largest stage cost. The bottleneck ``cap`` is the smallest largest stage cost over cuts
    whose every stage costs at least ``floor``, if that is at most ``best + floor``; else ``best``.
    Among cuts with no stage above ``cap``, the one with the largest smallest stage; ties go to the
    cut whose cut points, compared from the last, are smallest. Exact, O(k n^2).
    """
    n = len(costs)
    check_stage_count(n, num_stages)
    if not 0.0 <= negligible < 1.0:
        raise UsageError(f"negligible: a share of the total cost in [0, 1), got {negligible}")
    prefix = [0.0, *accumulate(costs)]
    floor = negligible * prefix[n]
    best = _smallest_bottleneck(prefix, num_stages, 0.0)
    without_negligible = _smallest_bottleneck(prefix, num_stages, floor)
    cap = without_negligible if without_negligible <= best + floor else best
    smallest = _largest_smallest_stage(prefix, num_stages, cap)
    return _earliest_cuts_from_the_end(prefix, num_stages, smallest, cap)


def _smallest_bottleneck(prefix: Sequence[float], num_stages: int, low: float) -> float:
    """Smallest largest stage cost over cuts whose stages all cost at least ``low`` (inf if none)."""
    n = len(prefix) - 1
    # value[i]: for the current k, the smallest largest cost of cutting blocks[:i] into k stages.
    value = [0.0] + [inf] * n
    for k in range(1, num_stages + 1):
        value = [
            min(
                (max(value[j], prefix[i] - prefix[j]) for j in range(k - 1, i) if prefix[i] - prefix[j] >= low),
                default=inf,
            )
            if i >= k
            else inf
            for i in range(n + 1)
        ]
    return value[n]


def _largest_smallest_stage(prefix: Sequence[float], num_stages: int, high: float) -> float:
    """Largest smallest stage cost over cuts whose stages all cost at most ``high`` (-inf if none)."""
    n = len(prefix) - 1
    value = [inf] + [-inf] * n
    for k in range(1, num_stages + 1):
        value = [
            max(
                (min(value[j], prefix[i] - prefix[j]) for j in range(k - 1, i) if prefix[i] - prefix[j] <= high),
                default=-inf,
            )
            if i >= k
            else -inf
            for i in range(n + 1)
        ]
    return value[n]


def _earliest_cuts_from_the_end(prefix: Sequence[float], num_stages: int, low: float, high: float) -> list[int]:
    """The cut with every stage cost in [low, high] whose cut points, from the last, are smallest."""
    n = len(prefix) - 1

    def fits(j: int, i: int) -> bool:
        return low <= prefix[i] - prefix[j] <= high

    # feasible[k][i]: blocks[:i] can be cut into k stages, each costing within [low, high].
    feasible = [[i == 0 for i in range(n + 1)]]
    for k in range(1, num_stages + 1):
        row = feasible[-1]
        feasible.append([any(row[j] and fits(j, i) for j in range(k - 1, i)) for i in range(n + 1)])
    bounds = [n]
    for k in range(num_stages, 0, -1):
        i = bounds[-1]
        bounds.append(next(j for j in range(k - 1, i) if feasible[k - 1][j] and fits(j, i)))
    return bounds[::-1]


def plan_stages(
    block_names: Sequence[str],
    bounds: Sequence[int],
    param_counts: Sequence[int],
    seconds: Sequence[float] | None = None,
) -> list[StagePlan]:
    """The report of a partition: blocks, parameter share and (when profiled) time per stage."""
    total = sum(param_counts) or 1
    plans = []
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        params = sum(param_counts[start:stop])
        plans.append(
            StagePlan(
                index=index,
                blocks=tuple(block_names[start:stop]),
                params=params,
                param_share=params / total,
                seconds=None if seconds is None else sum(seconds[start:stop]),
            )
        )
    return plans


def profile_blocks(
    model: nn.Module,
    blocks: Sequence[Block],
    sample: Tensor,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    autocast_bf16: bool = False,
) -> list[float]:
    """Median forward+backward seconds of each block on ``device``, for one input ``sample``.

    ``sample`` should be shaped like one micro-batch: per-sample cost is not constant in the
    batch size (small batches cost more per sample on CPU). Runs on a copy in train mode, so the
    caller's BatchNorm statistics and gradients stay untouched. One warm-up pass is not counted.
    """
    device = torch.device(device)
    dtype = next(model.parameters()).dtype
    model = copy.deepcopy(model).to(device).train()
    x = sample.to(device=device, dtype=dtype) if sample.is_floating_point() else sample.to(device)
    samples: list[list[float]] = [[] for _ in blocks]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext()
    for repeat in range(repeats + 1):
        h: Carry = x
        for index, block in enumerate(blocks):
            # Later stages receive their input as a leaf that needs a gradient; time that too.
            inp = _leaf(h, index > 0)
            _synchronize(device)
            start = time.perf_counter()
            with autocast:
                out = block.forward_on(model, inp)
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            _synchronize(device)
            if repeat > 0:
                samples[index].append(time.perf_counter() - start)
            h = out
    return [statistics.median(s) for s in samples]


def _leaf(carry: Carry, needs_grad: bool) -> Carry:
    if isinstance(carry, tuple):
        return tuple(_leaf(t, needs_grad) for t in carry)  # type: ignore[return-value]
    return carry.detach().requires_grad_(needs_grad and carry.is_floating_point())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
