"""Pipeline schedules: their names and limits, and what GPipe and 1F1B run in which order.

Job: the pure side of the schedules. ``SCHEDULES`` names what ``PipelineTrainer`` runs (the runtime
is ``torch.distributed.pipelining``'s, see ``stage``); ``check_schedule`` refuses, before any actor
starts, what torch's schedules would refuse at run time; ``ideal_bubble`` is a schedule's bubble
when every op costs the same, ``bubble_for_stage_times`` GPipe's when the stages differ; and ``gpipe``/``one_f_one_b`` spell out, per stage, the op order that
torch's ``ScheduleGPipe`` and ``Schedule1F1B`` follow, which is what the benchmark's memory model and
these tests reason about. No Ray, no torch.

An op is ``("F", j)`` or ``("B", j)``: the forward or backward of micro-batch ``j``. Stage ``s``
runs its list top to bottom. Dependencies: F(s, j) needs F(s-1, j); B(s, j) needs F(s, j) and
B(s+1, j). ``clock_ticks`` runs every op as soon as its stage is free and its inputs exist (one
tick per op), which is the schedule's picture when all ops cost the same.

GPipe (all forwards, then all backwards), 3 stages, 4 micro-batches; ``F2`` is the forward of
micro-batch 2, a row is a stage, a column a tick::

    tick   0  1  2  3  4  5  6  7  8  9 10 11
    s0    F0 F1 F2 F3             B0 B1 B2 B3
    s1       F0 F1 F2 F3       B0 B1 B2 B3
    s2          F0 F1 F2 F3 B0 B1 B2 B3

1F1B (PipeDream-flush): stage s runs ``num_stages - 1 - s`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. The same 12 ticks, but stage s never
holds more than ``num_stages - s`` micro-batches' activations (GPipe holds all of them)::

    tick   0  1  2  3  4  5  6  7  8  9 10 11
    s0    F0 F1 F2       B0 F3 B1    B2    B3
    s1       F0 F1    B0 F2 B1 F3 B2    B3
    s2          F0 B0 F1 B1 F2 B2 F3 B3

Invariants (tested exhaustively for 1-8 stages and 1-16 micro-batches):
- every (stage, micro-batch) forward and backward appears exactly once;
- each stage runs its forwards, and its backwards, in micro-batch order, so every stage updates
  BatchNorm statistics and accumulates gradients in the same order as one process would;
- the tick view respects every dependency and never deadlocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from raytrain_mp.errors import UsageError

Op = tuple[str, int]
FORWARD, BACKWARD = "F", "B"
# One stage per rank, and the interleaved ones with several ("virtual") stages per rank.
FLAT_SCHEDULES = ("gpipe", "1f1b")
INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "interleaved-zb")
SCHEDULES = FLAT_SCHEDULES + INTERLEAVED_SCHEDULES
# Every forward, then every backward: the step pays the slowest stage of each phase separately.
FILL_DRAIN_SCHEDULES = ("gpipe",)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise UsageError(f"num_stages: need at least 1 stage, got {num_stages}")
    if num_microbatches < 1:
        raise UsageError(f"num_microbatches: need at least 1 micro-batch, got {num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """Per-stage ops of GPipe: every forward, then every backward."""
    _check_sizes(num_stages, num_microbatches)
    ops = [(FORWARD, j) for j in range(num_microbatches)] + [(BACKWARD, j) for j in range(num_microbatches)]
    return [list(ops) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """Per-stage ops of 1F1B: warm-up forwards, one-forward-one-backward, cool-down backwards.

    Needs ``num_microbatches >= num_stages``: with fewer, the first stage never reaches its
    steady phase and the schedule is GPipe with extra waiting.
    """
    _check_sizes(num_stages, num_microbatches)
    if num_microbatches < num_stages:
        raise UsageError(
            f"num_microbatches: 1F1B over {num_stages} stages needs at least {num_stages} micro-batches, "
            f"got {num_microbatches}; use more micro-batches or the gpipe schedule"
        )
    schedule = []
    for stage in range(num_stages):
        warmup = num_stages - 1 - stage
        ops = [(FORWARD, j) for j in range(warmup)]
        for j in range(num_microbatches - warmup):
            ops += [(FORWARD, warmup + j), (BACKWARD, j)]
        ops += [(BACKWARD, j) for j in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(ops)
    return schedule


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """The per-stage ops of the flat schedule called ``name`` (one of ``FLAT_SCHEDULES``)."""
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(num_stages, num_microbatches)
    raise UsageError(f"schedule: unknown schedule {name!r}; accepted: {', '.join(FLAT_SCHEDULES)}")


def check_schedule(name: str, num_ranks: int, virtual_stages: int, num_microbatches: int) -> None:
    """Raise ``UsageError`` for what torch's schedule ``name`` cannot run: ``num_ranks`` ranks with
    ``virtual_stages`` stages each, over ``num_microbatches`` micro-batches."""
    if name not in SCHEDULES:
        raise UsageError(f"schedule: unknown schedule {name!r}; accepted: {', '.join(SCHEDULES)}")
    _check_sizes(num_ranks, num_microbatches)
    if name in FLAT_SCHEDULES and virtual_stages != 1:
        raise UsageError(
            f"virtual_stages: the {name} schedule runs one stage per rank, got {virtual_stages}; "
            f"use {' or '.join(INTERLEAVED_SCHEDULES)} for several"
        )
    if name in INTERLEAVED_SCHEDULES:
        if virtual_stages < 2:
            raise UsageError(f"virtual_stages: {name} needs at least 2 stages per rank, got {virtual_stages}")
        # Torch runs the micro-batches in rounds of about one per rank, all rounds equal.
        rounds = max(1, num_microbatches // num_ranks)
        if num_microbatches % rounds:
            raise UsageError(
                f"num_microbatches: {name} over {num_ranks} ranks runs {rounds} equal rounds of micro-batches, "
                f"so m must be a multiple of {rounds}, got {num_microbatches}"
            )
    if name == "1f1b":
        one_f_one_b(num_ranks, num_microbatches)


def ideal_bubble(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The share of the ranks' time a schedule leaves idle when every forward and backward costs
    the same and communication is free: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
    interleaved 1F1B (Narayanan et al., 2021). The zero-bubble schedule has no closed form here."""
    p, m = num_ranks, num_microbatches
    if name in FLAT_SCHEDULES:
        return (p - 1) / (m + p - 1)
    if name == "interleaved-1f1b":
        return (p - 1) / (virtual_stages * m + p - 1)
    raise UsageError(f"schedule: no closed-form bubble for {name!r}; accepted: gpipe, 1f1b, interleaved-1f1b")


def _dependencies(stage: int, op: Op, num_stages: int) -> list[tuple[int, Op]]:
    kind, j = op
    if kind == FORWARD:
        return [(stage - 1, op)] if stage > 0 else []
    upstream = [(stage + 1, op)] if stage < num_stages - 1 else []
    return [(stage, (FORWARD, j)), *upstream]


def clock_ticks(schedule: list[list[Op]]) -> list[list[tuple[int, Op]]]:
    """Ops grouped by the tick they run at, each stage one op per tick, as early as possible.

    Flattening the ticks gives a global order in which every op comes after its dependencies and
    each stage's ops keep their order: the order the driver submits them in.
    """
    num_stages = len(schedule)
    done: set[tuple[int, Op]] = set()
    position = [0] * num_stages
    ticks = []
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        tick = [
            (s, schedule[s][position[s]])
            for s in range(num_stages)
            if position[s] < len(schedule[s])
            and all(dep in done for dep in _dependencies(s, schedule[s][position[s]], num_stages))
        ]
        if not tick:
            waiting = [(s, schedule[s][position[s]]) for s in range(num_stages) if position[s] < len(schedule[s])]
            raise ValueError(f"schedule deadlocks at tick {len(ticks)}; waiting: {waiting}")
        for s, op in tick:
            position[s] += 1
        done.update(tick)
        ticks.append(tick)
    return ticks


def format_ticks(ticks: list[list[tuple[int, Op]]], num_stages: int) -> str:
    """The ASCII table of the module docstring: one row per stage, one column per tick."""
    rows = ["tick " + "".join(f"{t:>3}" for t in range(len(ticks)))]
    for stage in range(num_stages):
        cells = {t: f"{kind}{j}" for t, tick in enumerate(ticks) for s, (kind, j) in tick if s == stage}
        rows.append(f"s{stage:<4}" + "".join(f"{cells.get(t, ''):>3}" for t in range(len(ticks))))
    return "\n".join(row.rstrip() for row in rows)


def bubble_for_stage_times(
    busy_seconds: Sequence[float], num_microbatches: int, forward_seconds: Sequence[float] | None = None
) -> float:
    """GPipe's idle share when stage s computes ``busy_seconds[s]`` per step and communication is
    free: what a perfect runtime would show with these stages, so the measured bubble minus this
    is the runtime's own cost. Equal stages give ``ideal_bubble``.

    Without ``forward_seconds`` (forward and backward in the same proportion on every stage) the
    step takes one micro-batch through every stage plus m - 1 micro-batches of the slowest,
    sum(t)/m + (m-1)/m * max(t); 1F1B fills and drains the same way, so it holds for 1F1B to first
    order. With ``forward_seconds[s]``, the forward part of ``busy_seconds[s]``, GPipe's phases count
    apart (each is a flow shop of identical jobs): sum(t)/m + (m-1)/m * (max(f) + max(t - f))."""
    m = num_microbatches
    if forward_seconds is None:
        slowest = max(busy_seconds)
    else:
        slowest = max(forward_seconds) + max(t - f for t, f in zip(busy_seconds, forward_seconds))
    step = sum(busy_seconds) / m + (m - 1) / m * slowest
    return 1 - sum(busy_seconds) / (len(busy_seconds) * step)
