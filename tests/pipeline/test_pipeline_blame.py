"""Which rank a failed pipeline call names (``blame``), without Ray running: the kinds read off
Ray's errors, the failure stories of gloo and NCCL ranks, and every sequence of up to three
failures with every set of silent ranks checked against the rules they must keep.
"""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from raytrain_mp.pipeline.blame import Blame, Kind, blame, failure_kind, unsettled

KINDS: tuple[Kind, ...] = ("died", "exited", "raised", "lost_peer")
ORDER = {"died": 0, "exited": 0, "raised": 1, "lost_peer": 2}

# What Ray 2.60 says of an actor whose process aborted itself (os.abort, as NCCL's watchdog does).
ABORTED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: StageWorker\n\tpid: 4242\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
    "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some potential "
    "root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage."
)
KILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: StageWorker\n"
    "The actor is dead because it was killed by `ray.kill`."
)
NODE_DIED = (
    "The actor died unexpectedly before finishing this task.\nThe actor died because its node has died. Node Id: ab12"
)
GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
    "Timed out waiting 3000ms for recv operation to complete"
)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RayActorError(error_msg=ABORTED), "exited"),
        (RayActorError(error_msg=KILLED), "died"),
        (RayActorError(error_msg=NODE_DIED), "died"),
        (ActorDiedError(), "died"),
        (RayTaskError("train_steps", "tb", RuntimeError(GLOO_TIMEOUT)), "lost_peer"),
        (RayTaskError("train_steps", "tb", dist.DistBackendError("NCCL communicator was aborted")), "lost_peer"),
        (RayTaskError("train_steps", "tb", IndexError("Target 7 is out of bounds.")), "raised"),
        (RayTaskError("train_steps", "tb", RuntimeError("mat1 and mat2 shapes cannot be multiplied")), "raised"),
    ],
)
def test_failure_kind(error: Exception, kind: str) -> None:
    assert failure_kind(error) == kind


@pytest.mark.parametrize(
    ("failures", "silent", "outlived", "expected"),
    [
        # gloo: stage 1 hangs (SIGSTOP), stage 0's receive times out and raises.
        ([(0, "lost_peer")], [1], False, Blame(0, 1)),
        # NCCL: the same, but the watchdog aborts stage 0; stage 1 stays silent past a timeout.
        ([(0, "exited")], [1], True, Blame(0, 1)),
        # NCCL, 3 stages, stage 1 hangs: both neighbours abort, it outlives them.
        ([(2, "exited"), (0, "exited")], [1], True, Blame(0, 1)),
        # NCCL, 3 stages, stage 2 hangs: stage 1 aborts on it, then stage 0 on stage 1.
        ([(1, "exited"), (0, "exited")], [2], True, Blame(0, 2)),
        # NCCL: stage 0 killed by the OOM killer, stage 1 aborts within a timeout of it.
        ([(0, "exited"), (1, "exited")], [], False, Blame(0, None)),
        # NCCL, 3 stages: stage 1 crashes, both neighbours abort on it.
        ([(1, "exited"), (2, "exited"), (0, "exited")], [], False, Blame(0, None)),
        # NCCL, 3 stages: stage 0 crashes, stage 1 aborts on it, stage 2 on stage 1 (a chain).
        ([(0, "exited"), (1, "exited"), (2, "exited")], [], False, Blame(0, None)),
        # gloo: stage 0 crashes; its peer reports the closed connection before Ray reports the death.
        ([(1, "lost_peer"), (0, "exited")], [], False, Blame(1, None)),
        ([(1, "lost_peer"), (0, "died")], [], False, Blame(1, None)),
        # NCCL: stage 1 raises its own error; stage 0's watchdog aborts it while it waits.
        ([(1, "raised"), (0, "exited")], [], False, Blame(0, None)),
        ([(1, "raised")], [0], False, Blame(0, None)),
        # NCCL: ray.kill of stage 0; stage 1 still waits (or aborts later): the kill is named at once.
        ([(0, "died")], [1], False, Blame(0, None)),
        ([(0, "died"), (1, "exited")], [], False, Blame(0, None)),
        # A rank's own error outranks a rank that lost its peer, whatever came first.
        ([(0, "lost_peer"), (1, "raised")], [], False, Blame(1, None)),
        # An exit still unsettled (the driver has not waited a timeout yet) names the exited rank.
        ([(0, "exited")], [1], False, Blame(0, None)),
    ],
)
def test_blame_in_the_failure_stories_of_gloo_and_nccl(
    failures: list[tuple[int, Kind]], silent: list[int], outlived: bool, expected: Blame
) -> None:
    assert blame(failures, silent, outlived) == expected


def test_an_exit_after_a_lost_peer_is_the_origin_and_an_exit_after_it_a_reaction() -> None:
    # gloo's stage 1 reports stage 0's closed connection first; stage 0 crashed; stage 2 (NCCL) aborted on it
    story: list[tuple[int, Kind]] = [(1, "lost_peer"), (0, "exited"), (2, "exited")]
    assert blame(story, []) == Blame(1, None)  # the failure of stage 0


def _stories() -> list[tuple[list[tuple[int, Kind]], list[int]]]:
    """Every sequence of 1-3 failures of distinct ranks among 4, with every set of the other ranks silent."""
    stories = []
    for length in (1, 2, 3):
        for kinds in itertools.product(KINDS, repeat=length):
            failures = list(zip(range(length), kinds))
            others = range(length, 4)
            for count in range(len(others) + 1):
                for silent in itertools.combinations(others, count):
                    stories.append((failures, list(silent)))
    return stories


STORIES = _stories()


@pytest.mark.parametrize("outlived", [False, True])
def test_every_story_keeps_the_rules(outlived: bool) -> None:
    for failures, silent in STORIES:
        index, hung = blame(failures, silent, outlived)
        kinds = [kind for _, kind in failures]
        # An exit counts as a lost peer when it follows a death, an own error or an exit, or when the
        # silent ranks outlived every failure.
        reacted = [
            kind == "exited" and ((outlived and bool(silent)) or any(k != "lost_peer" for k in kinds[:i]))
            for i, kind in enumerate(kinds)
        ]
        orders = [2 if reacted[i] else ORDER[kind] for i, kind in enumerate(kinds)]
        assert orders[index] == min(orders), (failures, silent)
        assert index == orders.index(min(orders)), (failures, silent)  # the first seen among equals
        assert hung == (silent[0] if silent and min(orders) == 2 else None), (failures, silent)
        # A named silent rank is named after a rank that waited for it.
        if hung is not None:
            assert kinds[index] in ("lost_peer", "exited")


def test_outlived_matters_only_for_exits_with_silent_ranks() -> None:
    for failures, silent in STORIES:
        if "exited" not in [kind for _, kind in failures] or not silent:
            assert blame(failures, silent, True) == blame(failures, silent, False), (failures, silent)


def test_without_exits_the_rule_is_the_gloo_one() -> None:
    # gloo never aborts a rank: a dead actor, then an own error, then a lost peer; a silent rank
    # is named when only lost peers failed. Ties go to the first seen.
    for failures, silent in STORIES:
        kinds = [kind for _, kind in failures]
        if "exited" in kinds:
            continue
        index, hung = blame(failures, silent)
        best = min(ORDER[kind] for kind in kinds)
        assert index == [ORDER[kind] for kind in kinds].index(best)
        assert hung == (silent[0] if silent and best == 2 else None)


def test_unsettled_is_an_exit_named_while_ranks_are_silent_and_outliving_settles_it() -> None:
    for failures, silent in STORIES:
        index, hung = blame(failures, silent)
        expected = bool(silent) and hung is None and failures[index][1] == "exited"
        assert unsettled(failures, silent) == expected, (failures, silent)
        if expected:  # once the silent ranks outlive it, no exit is the origin any more
            settled = blame(failures, silent, True)
            assert settled.hung is not None or failures[settled.failure][1] != "exited", (failures, silent)
