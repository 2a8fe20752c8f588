"""Pipeline schedules, exhaustively: 1-8 stages x 1-16 micro-batches, GPipe and 1F1B."""

from __future__ import annotations

import pytest

from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline import schedule as sched
from raytrain_mp.pipeline.schedule import build_schedule, clock_ticks, format_ticks, gpipe, one_f_one_b

CASES = [(name, s, m) for name in sched.SCHEDULES for s in range(1, 9) for m in range(1, 17)]
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
    # neither schedule adds bubbles beyond fill and drain
    assert len(ticks) == 2 * (num_microbatches + num_stages - 1)


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
        (("zero-bubble", 2, 4), "schedule: unknown schedule 'zero-bubble'; accepted: gpipe, 1f1b"),
    ],
)
def test_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(UsageError) as info:
        build_schedule(*args)
    assert str(info.value) == message


def test_clock_ticks_detects_deadlock() -> None:
    with pytest.raises(ValueError, match="deadlocks at tick 0"):
        clock_ticks([[("B", 0), ("F", 0)]])


@pytest.mark.parametrize("name", sched.SCHEDULES)
def test_docstring_diagrams_are_what_the_code_does(name: str) -> None:
    table = format_ticks(clock_ticks(build_schedule(name, 3, 4)), 3)
    assert "\n".join("    " + row for row in table.splitlines()) in sched.__doc__
