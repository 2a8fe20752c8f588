"""Pipeline schedules: the registry of what ``PipelineTrainer`` runs, the stage layouts, and what
GPipe and 1F1B run in which order.

Job: the pure side of the schedules. ``SCHEDULES`` maps each name to its ``Schedule`` entry, which
holds everything the rest of the package asks of a schedule: torch's class (the runtime is
``torch.distributed.pipelining``'s, see ``stage``), one or several stages per rank, whether it
fills and drains (GPipe-like), the receives a rank posts ahead, whether the last backward splits,
its ideal bubble, its limits and its stage layout. No other module branches on a schedule's name:
adding a schedule is one entry here plus its tests (docs/development.md). ``check_schedule``
refuses, before any actor starts, what torch's schedules would refuse at run time;
``ideal_bubble`` is a schedule's bubble when every op costs the same, ``bubble_for_stage_times``
GPipe's when the stages differ; ``stage_indices`` says which stages a rank holds; and
``gpipe``/``one_f_one_b`` spell out, per stage, the op order that torch's ``ScheduleGPipe`` and
``Schedule1F1B`` follow, which is what the benchmark's memory model and these tests reason about.
No Ray, and no torch until ``Schedule.torch_class`` loads a class.

An entry travels as it is: the trainer hands the ``Schedule`` object itself to its stage actors with
each call, so an entry registered in the driver alone (a test's) runs on actors in other processes.

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

Invariants of the registry (tested for every entry): a name is its entry's key; torch's class
takes one stage exactly when the entry says one stage per rank; posting ahead, splitting the last
backward, filling and draining and spelling out the op order are single-stage matters; a spelled-out
op order has the entry's ideal bubble; ``check_schedule`` accepts exactly what torch's class accepts.
Of a layout (tested for 1-8 ranks x 1-4 stages per rank): every stage lies on exactly one rank, each
rank's stages in pipeline order, stage 0 on rank 0 and the last stage on the last rank (the trainer
hands the inputs to rank 0 and the targets to the last rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raytrain_mp.errors import OptionError

Op = tuple[str, int]
FORWARD, BACKWARD = "F", "B"
# How a pipeline of ranks x V stages lies on the ranks (``stage_indices``). The loop: rank r holds
# stages r, r + ranks, ... (torch's interleaved schedules need it).
STAGE_LAYOUTS = ("loop",)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise OptionError("num_stages", f"need at least 1 stage, got {num_stages}")
    if num_microbatches < 1:
        raise OptionError("num_microbatches", f"need at least 1 micro-batch, got {num_microbatches}")


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
    _check_enough_microbatches("1F1B", num_stages, num_microbatches, num_stages)
    schedule = []
    for stage in range(num_stages):
        warmup = num_stages - 1 - stage
        ops = [(FORWARD, j) for j in range(warmup)]
        for j in range(num_microbatches - warmup):
            ops += [(FORWARD, warmup + j), (BACKWARD, j)]
        ops += [(BACKWARD, j) for j in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(ops)
    return schedule


def _check_enough_microbatches(title: str, num_stages: int, num_microbatches: int, least: int) -> None:
    if num_microbatches < least:
        raise OptionError(
            "num_microbatches",
            f"{title} over {num_stages} stages needs at least {least} micro-batches, "
            f"got {num_microbatches}; use more micro-batches or the gpipe schedule",
        )


def _fill_and_drain_bubble(ranks: int, microbatches: int, virtual: int) -> float:
    return (ranks - 1) / (microbatches + ranks - 1)


def _interleaved_bubble(ranks: int, microbatches: int, virtual: int) -> float:
    return (ranks - 1) / (virtual * microbatches + ranks - 1)  # Narayanan et al., 2021


@dataclass(frozen=True)
class Schedule:
    """One schedule ``PipelineTrainer`` runs: what the trainer, its stage actors, the run loop and
    the benchmark ask of it. Frozen, hashable and picklable: it travels to the actors as it is."""

    name: str  # what --schedule takes
    title: str  # its name in messages
    torch_name: str  # its class in torch.distributed.pipelining (``torch_class``)
    # Several ("virtual") stages per rank, torch's class taking the rank's list of stages and
    # ``virtual_stages >= 2``; else exactly one stage per rank.
    multi_stage: bool = False
    # Every forward, then every backward: the step pays the slowest stage of each phase apart, which
    # the time balance and the stage-times bubble count.
    fill_drain: bool = False
    # The receives a rank posts at the start of a step on gloo (``stage._TimedStage.post_receives``):
    # "forward", the activations from the previous rank; "backward", the gradients from the next.
    # Torch's schedules post a receive only when they need its data; on gloo a message that
    # arrived before that waits for the call and costs another exchange between the ranks.
    # Measured on the overhead MLP (2 ranks, 2 cores, ms a step, torch's posting -> posted ahead),
    # m = 4, 8, 16: GPipe 4.1, 8.7, 13.7 -> 2.1, 3.9, 7.1 with both directions (each alone gains
    # less); 1F1B 2.7, 5.2, 12.8 -> 2.5, 4.1, 10.8 with the gradients only (its activations too made
    # it slower, 8.1 ms at m=8, likely as gloo's thread then reads them while the rank computes a
    # backward, on cores the two ranks already fill). The interleaved schedules receive both
    # directions from one peer when there are 2 ranks, in an order only their runtime knows, so
    # they post as torch does. GPUs always post as torch does (``stage``).
    post_ahead: tuple[str, ...] = ()
    # The rank's backward of the step's last micro-batch computes its input gradients first and its
    # weight gradients at the schedule's end (``stage._TimedStage.split_last_backward``).
    split_last_backward: bool = False
    # The idle share of the ranks when every op costs the same: (ranks, m, virtual) -> bubble;
    # None where there is no closed form here.
    bubble: Callable[[int, int, int], float] | None = None
    # The per-stage op order spelled out here ((num_stages, m) -> ops per stage), or None.
    ops: Callable[[int, int], list[list[Op]]] | None = None
    # Limits: m >= this x the ranks; m a multiple of its number of rounds of about one micro-batch
    # per rank (torch's interleaved schedules).
    min_microbatches_per_rank: int = 0
    equal_rounds: bool = False
    layout: str = "loop"  # one of STAGE_LAYOUTS: which stages each rank holds

    def torch_class(self) -> type:
        """Torch's schedule class (loads torch)."""
        import torch.distributed.pipelining as pipelining

        return getattr(pipelining, self.torch_name)


SCHEDULES: dict[str, Schedule] = {
    entry.name: entry
    for entry in (
        Schedule("gpipe", "GPipe", "ScheduleGPipe", fill_drain=True, post_ahead=("forward", "backward"),
                 split_last_backward=True, bubble=_fill_and_drain_bubble, ops=gpipe),
        Schedule("1f1b", "1F1B", "Schedule1F1B", post_ahead=("backward",), split_last_backward=True,
                 bubble=_fill_and_drain_bubble, ops=one_f_one_b, min_microbatches_per_rank=1),
        Schedule("interleaved-1f1b", "interleaved 1F1B", "ScheduleInterleaved1F1B", multi_stage=True,
                 bubble=_interleaved_bubble, equal_rounds=True),
        Schedule("interleaved-zb", "interleaved zero bubble", "ScheduleInterleavedZeroBubble", multi_stage=True,
                 equal_rounds=True),
    )
}  # fmt: skip


def schedule_entry(name: str, accepted: Sequence[str] | None = None) -> Schedule:
    """The entry of schedule ``name``; ``UsageError`` unless it is registered (and in ``accepted``)."""
    accepted = list(SCHEDULES) if accepted is None else accepted
    if name not in accepted:
        raise OptionError("schedule", f"unknown schedule {name!r}; accepted: {', '.join(accepted)}")
    return SCHEDULES[name]


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """The per-stage ops of the schedule called ``name``, of those whose op order is spelled out here."""
    ops = schedule_entry(name, [other for other, entry in SCHEDULES.items() if entry.ops is not None]).ops
    return ops(num_stages, num_microbatches)


def check_schedule(
    name: str, num_ranks: int, virtual_stages: int, num_microbatches: int, layout: str | None = None
) -> None:
    """Raise ``UsageError`` for what torch's schedule ``name`` cannot run: ``num_ranks`` ranks with
    ``virtual_stages`` stages each, over ``num_microbatches`` micro-batches; and, given the
    ``layout`` of running stages, a schedule that lays its stages out otherwise."""
    entry = schedule_entry(name)
    _check_sizes(num_ranks, num_microbatches)
    if not entry.multi_stage and virtual_stages != 1:
        several = " or ".join(other for other, e in SCHEDULES.items() if e.multi_stage)
        raise OptionError(
            "virtual_stages",
            f"the {name} schedule runs one stage per rank, got {virtual_stages}; use {several} for several",
        )
    if entry.multi_stage and virtual_stages < 2:
        raise OptionError("virtual_stages", f"{name} needs at least 2 stages per rank, got {virtual_stages}")
    if entry.equal_rounds:
        # Torch runs the micro-batches in rounds of about one per rank, all rounds equal.
        rounds = max(1, num_microbatches // num_ranks)
        if num_microbatches % rounds:
            raise OptionError(
                "num_microbatches",
                f"{name} over {num_ranks} ranks runs {rounds} equal rounds of micro-batches, "
                f"so m must be a multiple of {rounds}, got {num_microbatches}",
            )
    _check_enough_microbatches(entry.title, num_ranks, num_microbatches, entry.min_microbatches_per_rank * num_ranks)
    if layout is not None and entry.layout != layout:
        raise OptionError(
            "schedule", f"{name} lays its stages out as {entry.layout!r}, the running stages lie as {layout!r}"
        )


def ideal_bubble(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The share of the ranks' time a schedule leaves idle when every forward and backward costs
    the same and communication is free: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
    interleaved 1F1B (Narayanan et al., 2021). The zero-bubble schedule has no closed form here."""
    bubble = schedule_entry(name).bubble
    if bubble is None:
        formulas = ", ".join(other for other, entry in SCHEDULES.items() if entry.bubble is not None)
        raise OptionError("schedule", f"no closed-form bubble for {name!r}; accepted: {formulas}")
    return bubble(num_ranks, num_microbatches, virtual_stages)


def stage_times_bubble(
    name: str, busy_seconds: Sequence[float], num_microbatches: int, forward_seconds: Sequence[float]
) -> float | None:
    """``bubble_for_stage_times`` for schedule ``name``, the stages' computing seconds and the
    forward part of them: the fill-drain schedules count the phases apart; None for schedules with
    several stages per rank, which that formula does not model."""
    entry = schedule_entry(name)
    if entry.multi_stage:
        return None
    return bubble_for_stage_times(busy_seconds, num_microbatches, forward_seconds if entry.fill_drain else None)


def stage_indices(rank: int, ranks: int, virtual: int, layout: str) -> list[int]:
    """The pipeline indices of the stages rank ``rank`` of ``ranks`` holds, ``virtual`` each, in
    pipeline order, under ``layout`` (one of ``STAGE_LAYOUTS``). The loop, 2 ranks x 3 stages:
    rank 0 holds [0, 2, 4], rank 1 [1, 3, 5]."""
    if not 0 <= rank < ranks or virtual < 1:
        raise ValueError(f"no rank {rank} of {ranks} with {virtual} stages each")
    if layout == "loop":
        return [rank + local * ranks for local in range(virtual)]
    raise ValueError(f"unknown stage layout {layout!r}; known: {', '.join(STAGE_LAYOUTS)}")


def stage_rank(index: int, ranks: int, virtual: int, layout: str) -> int:
    """The rank that holds stage ``index`` under ``layout`` (the inverse of ``stage_indices``)."""
    for rank in range(ranks):
        if index in stage_indices(rank, ranks, virtual, layout):
            return rank
    raise ValueError(f"no stage {index} among {ranks} x {virtual}")


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
