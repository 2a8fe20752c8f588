"""Cut an ordered list of blocks into contiguous pipeline stages.

Job: decide which blocks each stage holds — from explicit split points, from per-block costs
(parameter counts, or forward and backward seconds measured by ``profile_blocks``: their sum
balanced for 1F1B-like schedules, each phase for GPipe's fill-drain) — and report each stage's
cost and parameter share. Pure: no Ray; profiling needs only torch.

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
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import accumulate
from math import inf

import torch
from torch import Tensor, nn

from raytrain_mp.config import LAYOUTS
from raytrain_mp.errors import OptionError, UsageError
from raytrain_mp.pipeline.block import Block, Carry

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
    forward_seconds: float | None = None  # of which the forward; None if not profiled


def check_stage_count(num_blocks: int, num_stages: int) -> None:
    if num_stages < 1:
        raise OptionError("num_stages", f"need at least 1 stage, got {num_stages}")
    if num_stages > num_blocks:
        raise OptionError(
            "num_stages", f"{num_stages} stages for {num_blocks} blocks; each stage needs at least one block"
        )


def split_bounds(block_names: Sequence[str], split_points: Sequence[str], num_stages: int) -> list[int]:
    """Bounds that cut before each split point.

    A split point names a block (``"layer3.0"``) or a group of blocks by prefix (``"layer3"``
    cuts before its first block, the seeds' ``seq1``/``seq2`` split).
    """
    check_stage_count(len(block_names), num_stages)
    if len(split_points) != num_stages - 1:
        raise OptionError(
            "split_points", f"{num_stages} stages need {num_stages - 1} split point(s), got {len(split_points)}"
        )
    bounds = [0]
    for point in split_points:
        start = _first_block(block_names, point)
        if start == 0:
            raise OptionError("split_points", f"cutting before {point!r} would leave stage 0 empty")
        if start <= bounds[-1]:
            raise OptionError(
                "split_points",
                f"{point!r} does not come after {block_names[bounds[-1]]!r}; give split points in model order",
            )
        bounds.append(start)
    return bounds + [len(block_names)]


def _first_block(block_names: Sequence[str], point: str) -> int:
    for index, name in enumerate(block_names):
        if name == point or name.startswith(f"{point}."):
            return index
    raise OptionError("split_points", f"{point!r} names no block; blocks: {', '.join(block_names)}")


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
    _check_negligible(negligible)
    prefix = [0.0, *accumulate(costs)]
    floor = negligible * prefix[n]
    best = _smallest_bottleneck(prefix, num_stages, _anything)
    without_negligible = _smallest_bottleneck(prefix, num_stages, _at_least(prefix, floor))
    cap = without_negligible if without_negligible <= best + floor else best
    within = _at_most(prefix, cap)
    smallest = _largest_smallest_stage(prefix, num_stages, within)
    return _earliest_cuts_from_the_end(prefix, num_stages, _both(within, _at_least(prefix, smallest)))


def balance_fill_drain_bounds(
    forward: Sequence[float], backward: Sequence[float], num_stages: int, negligible: float = NEGLIGIBLE_SHARE
) -> list[int]:
    """Contiguous bounds for a fill-drain schedule (GPipe): minimizing the largest stage forward
    plus the largest stage backward.

    GPipe runs every forward, then every backward; with m micro-batches each phase is a flow shop of
    identical jobs, whose makespan is the sum of the stage times plus (m - 1) times the largest. So
    the step takes ``sum(forward) + sum(backward) + (m - 1) * (max F + max B)`` (F, B: a stage's
    forward and backward seconds per micro-batch), and the cut that balances forward + backward
    (``balance_bounds``, right for 1F1B, whose stages alternate the two) is not the best one when
    the stages' forward/backward ratios differ: ResNet-50's early layers have relatively slower
    forwards than its late ones.

    The rule is ``balance_bounds``'s with the score ``J = max F + max B`` in place of the largest
    stage cost, and stage sizes ``forward + backward``: with ``floor = negligible * sum(forward +
    backward)``, the target is the smallest J over cuts whose every stage is at least ``floor`` if
    that is at most the smallest J plus ``floor``, else the smallest J; among cuts with J at most
    the target, the largest smallest stage, then the cut points, compared from the last, smallest.
    Exact: each candidate largest forward (a stage's forward sum) is tried, O(k n^2) each.
    """
    n = len(forward)
    if len(backward) != n:
        raise UsageError(f"backward: {len(backward)} backward times for {n} forward times")
    check_stage_count(n, num_stages)
    _check_negligible(negligible)
    pf, pb = [0.0, *accumulate(forward)], [0.0, *accumulate(backward)]
    size = [0.0, *accumulate(f + b for f, b in zip(forward, backward))]
    floor = negligible * size[n]
    # Every cut's largest F is one of these caps, and at least least_forward; its largest B is at
    # least least_backward.
    least_forward = _smallest_bottleneck(pf, num_stages, _anything)
    least_backward = _smallest_bottleneck(pb, num_stages, _anything)
    caps = sorted(c for c in {pf[i] - pf[j] for i in range(n + 1) for j in range(i)} if c >= least_forward)

    def smallest_score(allowed: Allowed) -> float:
        """Smallest J over cuts whose stages all pass ``allowed``."""
        best = inf
        for cap in caps:
            if cap + least_backward >= best:
                break  # J >= cap + least_backward from here on
            best = min(best, cap + _smallest_bottleneck(pb, num_stages, _both(allowed, _at_most(pf, cap))))
        return best

    best = smallest_score(_anything)
    without_negligible = smallest_score(_at_least(size, floor))
    target = without_negligible if without_negligible <= best + floor else best
    # The cuts with J <= target, as the union over caps on F of those whose every stage has F <= cap
    # and cap + B <= target: a cut's own largest F is such a cap.
    boxes = [_both(_at_most(pf, cap), _within_score(pb, cap, target)) for cap in caps if cap + least_backward <= target]
    smallest_of_box = [_largest_smallest_stage(size, num_stages, box) for box in boxes]
    smallest = max(smallest_of_box)
    chosen = (
        _earliest_cuts_from_the_end(size, num_stages, _both(box, _at_least(size, smallest)))
        for box, box_smallest in zip(boxes, smallest_of_box)
        if box_smallest == smallest
    )
    return min(chosen, key=lambda bounds: bounds[::-1])


def cut_score(forward: Sequence[float], backward: Sequence[float], bounds: Sequence[int], fill_drain: bool) -> float:
    """What a step pays per micro-batch on the cut ``bounds``: the largest stage forward plus the
    largest stage backward for a fill-drain schedule, else the largest stage forward+backward."""
    pf, pb = [0.0, *accumulate(forward)], [0.0, *accumulate(backward)]
    stages = list(zip(bounds, bounds[1:]))
    f = [pf[b] - pf[a] for a, b in stages]
    b = [pb[b] - pb[a] for a, b in stages]
    return max(f) + max(b) if fill_drain else max(x + y for x, y in zip(f, b))


def rescale_to_measured(
    costs: Sequence[float], bounds: Sequence[int], num_ranks: int, measured: Sequence[float]
) -> list[float]:
    """Per-block ``costs`` scaled so that each rank's blocks sum to what that rank ``measured``.

    Part p (blocks ``bounds[p]:bounds[p + 1]``) runs on rank ``p % num_ranks``; every block of rank
    r is scaled by ``measured[r]`` over the profiled sum of its blocks, so the profile's shares
    within a rank stay and the ranks' totals become the running stages' (a rank whose profiled sum
    is 0 keeps its costs).
    """
    rank_of_block = [0] * len(costs)
    for part, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        rank_of_block[start:stop] = [part % num_ranks] * (stop - start)
    profiled = [0.0] * num_ranks
    for cost, rank in zip(costs, rank_of_block):
        profiled[rank] += cost
    scale = [seconds / total if total > 0 else 1.0 for seconds, total in zip(measured, profiled)]
    return [cost * scale[rank] for cost, rank in zip(costs, rank_of_block)]


# A stage holding blocks[j:i] passes when allowed(j, i).
Allowed = Callable[[int, int], bool]


def _anything(j: int, i: int) -> bool:
    return True


def _at_least(prefix: Sequence[float], low: float) -> Allowed:
    return lambda j, i: prefix[i] - prefix[j] >= low


def _at_most(prefix: Sequence[float], high: float) -> Allowed:
    return lambda j, i: prefix[i] - prefix[j] <= high


def _within_score(prefix: Sequence[float], cap: float, target: float) -> Allowed:
    # cap + stage <= target, computed as J is (one float addition), so that J <= target exactly.
    return lambda j, i: cap + (prefix[i] - prefix[j]) <= target


def _both(first: Allowed, second: Allowed) -> Allowed:
    return lambda j, i: first(j, i) and second(j, i)


def _check_negligible(negligible: float) -> None:
    if not 0.0 <= negligible < 1.0:
        raise UsageError(f"negligible: a share of the total cost in [0, 1), got {negligible}")


def _smallest_bottleneck(prefix: Sequence[float], num_stages: int, allowed: Allowed) -> float:
    """Smallest largest stage cost over cuts whose stages all pass ``allowed`` (inf if none)."""
    n = len(prefix) - 1
    # value[i]: for the current k, the smallest largest cost of cutting blocks[:i] into k stages.
    value = [0.0] + [inf] * n
    for k in range(1, num_stages + 1):
        value = [
            min((max(value[j], prefix[i] - prefix[j]) for j in range(k - 1, i) if allowed(j, i)), default=inf)
            if i >= k
            else inf
            for i in range(n + 1)
        ]
    return value[n]


def _largest_smallest_stage(prefix: Sequence[float], num_stages: int, allowed: Allowed) -> float:
    """Largest smallest stage cost over cuts whose stages all pass ``allowed`` (-inf if none)."""
    n = len(prefix) - 1
    value = [inf] + [-inf] * n
    for k in range(1, num_stages + 1):
        value = [
            max((min(value[j], prefix[i] - prefix[j]) for j in range(k - 1, i) if allowed(j, i)), default=-inf)
            if i >= k
            else -inf
            for i in range(n + 1)
        ]
    return value[n]


def _earliest_cuts_from_the_end(prefix: Sequence[float], num_stages: int, allowed: Allowed) -> list[int]:
    """The cut with every stage passing ``allowed`` whose cut points, from the last, are smallest."""
    n = len(prefix) - 1
    # feasible[k][i]: blocks[:i] can be cut into k stages that all pass.
    feasible = [[i == 0 for i in range(n + 1)]]
    for k in range(1, num_stages + 1):
        row = feasible[-1]
        feasible.append([any(row[j] and allowed(j, i) for j in range(k - 1, i)) for i in range(n + 1)])
    bounds = [n]
    for k in range(num_stages, 0, -1):
        i = bounds[-1]
        bounds.append(next(j for j in range(k - 1, i) if feasible[k - 1][j] and allowed(j, i)))
    return bounds[::-1]


def plan_stages(
    block_names: Sequence[str],
    bounds: Sequence[int],
    param_counts: Sequence[int],
    seconds: Sequence[float] | None = None,
    forward_seconds: Sequence[float] | None = None,
) -> list[StagePlan]:
    """The report of a partition: blocks, parameter share and (when profiled) time per stage:
    per block, ``seconds`` forward+backward and ``forward_seconds`` the forward alone."""
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
                forward_seconds=None if forward_seconds is None else sum(forward_seconds[start:stop]),
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
    memory_format: str = "contiguous",
) -> list[tuple[float, float]]:
    """Median (forward, backward) seconds of each block on ``device``, for one input ``sample``,
    in ``memory_format`` (``config.MEMORY_FORMATS``; ``"auto"`` times both layouts and
    takes each block's faster one, a stage's measured choice being made over whole stages later).

    ``sample`` should be shaped like one micro-batch: per-sample cost is not constant in the
    batch size (small batches cost more per sample on CPU). Runs on a copy in train mode, so the
    caller's BatchNorm statistics and gradients stay untouched. One warm-up pass is not counted.
    """
    if memory_format == "auto":
        both = [profile_blocks(model, blocks, sample, device, repeats, autocast_bf16, layout) for layout in LAYOUTS]
        return [min(times, key=sum) for times in zip(*both)]
    device = torch.device(device)
    dtype = next(model.parameters()).dtype
    model = copy.deepcopy(model).to(device).train()
    x = sample.to(device=device, dtype=dtype) if sample.is_floating_point() else sample.to(device)
    if memory_format == "channels_last" and x.dim() == 4 and x.is_floating_point():
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    samples: list[list[tuple[float, float]]] = [[] for _ in blocks]
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
            _synchronize(device)
            forwarded = time.perf_counter()
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            _synchronize(device)
            if repeat > 0:
                samples[index].append((forwarded - start, time.perf_counter() - forwarded))
            h = out
    return [(statistics.median(f for f, _ in s), statistics.median(b for _, b in s)) for s in samples]


def _leaf(carry: Carry, needs_grad: bool) -> Carry:
    if isinstance(carry, tuple):
        return tuple(_leaf(t, needs_grad) for t in carry)  # type: ignore[return-value]
    return carry.detach().requires_grad_(needs_grad and carry.is_floating_point())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
