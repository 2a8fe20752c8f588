"""Pipeline schedules, exhaustively: GPipe and 1F1B op orders over 1-8 stages x 1-16 micro-batches;
the limits of every schedule against what torch's own schedule classes accept; ideal bubbles; the
registry's consistency; the stage layouts over 1-8 ranks x 1-4 stages per rank."""

from __future__ import annotations

import pickle

import pytest

from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline import schedule as sched
from raytrain_mp.pipeline.schedule import (
    SCHEDULES,
    Schedule,
    build_schedule,
    clock_ticks,
    format_ticks,
    gpipe,
    one_f_one_b,
)

SPELLED_OUT = [name for name, entry in SCHEDULES.items() if entry.ops is not None]  # gpipe, 1f1b
CASES = [(name, s, m) for name in SPELLED_OUT for s in range(1, 9) for m in range(1, 17)]
VALID = [case for case in CASES if case[0] == "gpipe" or case[2] >= case[1]]


@pytest.mark.parametrize(("name", "num_stages", "num_microbatches"), VALID)
def test_schedule_properties(name: str, num_stages: int, num_microbatches: int) -> None:
    ops = build_schedule(name, num_stages, num_microbatches)
    assert len(ops) == num_stages
    every = sorted((kind, j) for kind in "FB" for j in range(num_microbatches))
    for stage_ops in ops:
        assert sorted(stage_ops) == every  # each forward and backward exactly once
        # micro-batch order per kind: BatchNorm statistics and gradients accumulate as in one process
        assert [j for kind, j in stage_ops if kind == "F"] == list(range(num_microbatches))
        assert [j for kind, j in stage_ops if kind == "B"] == list(range(num_microbatches))

    ticks = clock_ticks(ops)
    at = {(s, op): t for t, tick in enumerate(ticks) for s, op in tick}
    assert len(at) == sum(len(stage_ops) for stage_ops in ops)
    for t, tick in enumerate(ticks):
        assert len({s for s, _ in tick}) == len(tick)  # a stage runs one op per tick
    for s, stage_ops in enumerate(ops):
        assert sorted(stage_ops, key=lambda op: at[s, op]) == stage_ops  # per-stage order kept
        for j in range(num_microbatches):
            if s > 0:
                assert at[s, ("F", j)] > at[s - 1, ("F", j)]
            if s < num_stages - 1:
                assert at[s, ("B", j)] > at[s + 1, ("B", j)]
            assert at[s, ("B", j)] > at[s, ("F", j)]
    # neither schedule adds bubbles beyond fill and drain: idle ticks are the ideal bubble
    assert len(ticks) == 2 * (num_microbatches + num_stages - 1)
    idle = 1 - 2 * num_microbatches / len(ticks)
    assert idle == pytest.approx(sched.ideal_bubble(name, num_stages, num_microbatches))


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(s, m) for _, s, m in VALID if _ == "1f1b"])
def test_1f1b_holds_at_most_stages_minus_s_activations(num_stages: int, num_microbatches: int) -> None:
    for s, stage_ops in enumerate(one_f_one_b(num_stages, num_microbatches)):
        held = peak = 0
        for kind, _ in stage_ops:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == min(num_stages - s, num_microbatches)


def test_gpipe_holds_every_microbatch() -> None:
    for stage_ops in gpipe(3, 5):
        assert stage_ops[:5] == [("F", j) for j in range(5)]


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(s, m) for _, s, m in CASES if m < s])
def test_1f1b_needs_as_many_microbatches_as_stages(num_stages: int, num_microbatches: int) -> None:
    with pytest.raises(UsageError) as info:
        one_f_one_b(num_stages, num_microbatches)
    assert str(info.value) == (
        f"num_microbatches: 1F1B over {num_stages} stages needs at least {num_stages} micro-batches, "
        f"got {num_microbatches}; use more micro-batches or the gpipe schedule"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("gpipe", 2, 0), "num_microbatches: need at least 1 micro-batch, got 0"),
        (("1f1b", 2, -1), "num_microbatches: need at least 1 micro-batch, got -1"),
        (("gpipe", 0, 4), "num_stages: need at least 1 stage, got 0"),
        (("interleaved-1f1b", 2, 4), "schedule: unknown schedule 'interleaved-1f1b'; accepted: gpipe, 1f1b"),
    ],
)
def test_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(UsageError) as info:
        build_schedule(*args)
    assert str(info.value) == message


def test_clock_ticks_detects_deadlock() -> None:
    with pytest.raises(ValueError, match="deadlocks at tick 0"):
        clock_ticks([[("B", 0), ("F", 0)]])


@pytest.mark.parametrize("name", SPELLED_OUT)
def test_docstring_diagrams_are_what_the_code_does(name: str) -> None:
    table = format_ticks(clock_ticks(build_schedule(name, 3, 4)), 3)
    assert "\n".join("    " + row for row in table.splitlines()) in sched.__doc__


LIMIT_CASES = [
    (name, ranks, virtual, m)
    for name, entry in SCHEDULES.items()
    for ranks in range(2, 5)
    for virtual in ((2, 3) if entry.multi_stage else (1,))
    for m in range(1, 13)
]


@pytest.mark.parametrize(("name", "ranks", "virtual", "m"), LIMIT_CASES)
def test_check_schedule_refuses_exactly_what_torch_refuses(name: str, ranks: int, virtual: int, m: int) -> None:
    """Torch builds its op lists on mock stages (its schedule visualizer); what it refuses, we refuse
    before any actor starts, and nothing else."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        get_schedule_ops(SCHEDULES[name].torch_class(), ranks, m, virtual)
        torch_accepts = True
    except ValueError:
        torch_accepts = False
    try:
        sched.check_schedule(name, ranks, virtual, m)
        we_accept = True
    except UsageError:
        we_accept = False
    assert we_accept == torch_accepts


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pipedream", 2, 1, 4),
         "schedule: unknown schedule 'pipedream'; accepted: gpipe, 1f1b, interleaved-1f1b, interleaved-zb"),
        (("gpipe", 2, 2, 4),
         "virtual_stages: the gpipe schedule runs one stage per rank, got 2; use interleaved-1f1b or interleaved-zb "
         "for several"),
        (("interleaved-1f1b", 2, 1, 4), "virtual_stages: interleaved-1f1b needs at least 2 stages per rank, got 1"),
        (("interleaved-zb", 2, 2, 5),
         "num_microbatches: interleaved-zb over 2 ranks runs 2 equal rounds of micro-batches, so m must be a "
         "multiple of 2, got 5"),
        (("1f1b", 3, 1, 2),
         "num_microbatches: 1F1B over 3 stages needs at least 3 micro-batches, got 2; use more micro-batches or the "
         "gpipe schedule"),
        (("gpipe", 2, 1, 0), "num_microbatches: need at least 1 micro-batch, got 0"),
    ],
)  # fmt: skip
def test_check_schedule_messages(args: tuple, message: str) -> None:
    with pytest.raises(UsageError) as info:
        sched.check_schedule(*args)
    assert str(info.value) == message


def test_ideal_bubbles() -> None:
    assert sched.ideal_bubble("gpipe", 2, 8) == pytest.approx(1 / 9)
    assert sched.ideal_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert sched.ideal_bubble("interleaved-1f1b", 2, 8, 2) == pytest.approx(1 / 17)  # v times smaller, about
    with pytest.raises(UsageError, match="no closed-form bubble for 'interleaved-zb'"):
        sched.ideal_bubble("interleaved-zb", 2, 8, 2)


def test_bubble_for_stage_times() -> None:
    for stages in range(1, 5):
        for m in (1, 4, 8):
            assert sched.bubble_for_stage_times([2.0] * stages, m) == pytest.approx(
                sched.ideal_bubble("gpipe", stages, m)
            )
    # one slow stage: 8 micro-batches take 1/8 + 2/8 + 7/8 * 2 = 2.125 s; busy 3 of 2 * 2.125
    assert sched.bubble_for_stage_times([1.0, 2.0], 8) == pytest.approx(1 - 3 / 4.25)
    # Forwards in the same proportion on every stage: the same figure.
    assert sched.bubble_for_stage_times([1.0, 2.0], 8, [0.25, 0.5]) == pytest.approx(1 - 3 / 4.25)
    # Stage 0 forward-heavy, stage 1 backward-heavy, equal totals: the plain formula sees balanced
    # stages, GPipe's phases do not. Per micro-batch f = (0.075, 0.05), b = (0.05, 0.075): the step
    # is 0.25 for the first micro-batch plus 7 x (0.075 + 0.075).
    assert sched.bubble_for_stage_times([1.0, 1.0], 8) == pytest.approx(sched.ideal_bubble("gpipe", 2, 8))
    assert sched.bubble_for_stage_times([1.0, 1.0], 8, [0.6, 0.4]) == pytest.approx(1 - 2 / (2 * (0.25 + 7 * 0.15)))


def test_stage_times_bubble_reads_the_entry() -> None:
    busy, forward = [1.0, 1.0], [0.6, 0.4]
    assert sched.stage_times_bubble("gpipe", busy, 8, forward) == sched.bubble_for_stage_times(busy, 8, forward)
    assert sched.stage_times_bubble("1f1b", busy, 8, forward) == sched.bubble_for_stage_times(busy, 8)
    assert sched.stage_times_bubble("interleaved-1f1b", busy, 8, forward) is None


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_registry_is_consistent(name: str) -> None:
    """What the stage actors and the trainer rely on, for every entry."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    entry = SCHEDULES[name]
    assert entry.name == name and entry.title and entry.layout in sched.STAGE_LAYOUTS
    assert issubclass(entry.torch_class(), PipelineScheduleMulti if entry.multi_stage else PipelineScheduleSingle)
    assert set(entry.post_ahead) <= {"forward", "backward"}
    if entry.multi_stage:  # these act on a rank's single stage (stage._TimedStage) or model one stage a rank
        assert not (entry.post_ahead or entry.split_last_backward or entry.fill_drain or entry.ops)
    for ranks in range(1, 9):
        for m in range(1, 17):
            for virtual in (1, 2, 4):
                if entry.bubble is not None:
                    assert 0 <= entry.bubble(ranks, m, virtual) < 1
                    assert (entry.bubble(ranks, m, virtual) == 0) == (ranks == 1)
    pickled = pickle.loads(pickle.dumps(entry))  # it travels to the actors as it is
    assert pickled == entry and hash(pickled) == hash(entry)


def test_the_registry_is_the_one_place_a_schedule_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry added at run time is a schedule like the others: checked, listed, refused with them."""
    entry = Schedule("looped-bfs", "looped BFS", "ScheduleLoopedBFS", multi_stage=True)
    monkeypatch.setitem(SCHEDULES, entry.name, entry)
    sched.check_schedule("looped-bfs", 2, 2, 5)
    with pytest.raises(UsageError, match="use interleaved-1f1b or interleaved-zb or looped-bfs for several"):
        sched.check_schedule("gpipe", 2, 2, 4)
    with pytest.raises(UsageError, match="no closed-form bubble for 'looped-bfs'"):
        sched.ideal_bubble("looped-bfs", 2, 4, 2)
    with pytest.raises(UsageError, match="schedule: unknown schedule 'looped-bfs'; accepted: gpipe, 1f1b$"):
        build_schedule("looped-bfs", 2, 4)
    # Running stages keep their layout: a schedule that lays them out otherwise is refused.
    monkeypatch.setitem(
        SCHEDULES, "v-test", Schedule("v-test", "V", "ScheduleZBVZeroBubble", multi_stage=True, layout="v")
    )
    with pytest.raises(UsageError, match="v-test lays its stages out as 'v', the running stages lie as 'loop'"):
        sched.check_schedule("v-test", 2, 2, 4, layout="loop")
    sched.check_schedule("looped-bfs", 2, 2, 4, layout="loop")


LAYOUT_CASES = [
    (layout, ranks, virtual) for layout in sched.STAGE_LAYOUTS for ranks in range(1, 9) for virtual in range(1, 5)
]


@pytest.mark.parametrize(("layout", "ranks", "virtual"), LAYOUT_CASES)
def test_stage_layouts(layout: str, ranks: int, virtual: int) -> None:
    held = [sched.stage_indices(rank, ranks, virtual, layout) for rank in range(ranks)]
    assert sorted(index for indices in held for index in indices) == list(range(ranks * virtual))  # each once
    for rank, indices in enumerate(held):
        assert len(indices) == virtual and indices == sorted(indices)  # in pipeline order
        assert all(sched.stage_rank(index, ranks, virtual, layout) == rank for index in indices)
    assert sched.stage_rank(0, ranks, virtual, layout) == 0  # the trainer hands the inputs to rank 0
    assert sched.stage_rank(ranks * virtual - 1, ranks, virtual, layout) == ranks - 1  # and the targets here
    if layout == "loop":  # rank r: r, r + ranks, ... (torch's interleaved schedules need this)
        assert held == [list(range(rank, ranks * virtual, ranks)) for rank in range(ranks)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 2, 1, "loop"), "no rank 2 of 2 with 1 stages each"),
        ((0, 2, 0, "loop"), "no rank 0 of 2 with 0 stages each"),
        ((0, 2, 2, "zigzag"), "unknown stage layout 'zigzag'; known: loop"),
    ],
)
def test_stage_indices_refuses(args: tuple, message: str) -> None:
    with pytest.raises(ValueError) as info:
        sched.stage_indices(*args)
    assert str(info.value) == message
    with pytest.raises(ValueError, match="no stage 4 among 2 x 2"):
        sched.stage_rank(4, 2, 2, "loop")
