"""A failed stage call: the error it raises and the wait for its peers' errors that names its origin.

Job: ``StageFailedError`` (what a caller of the trainer catches: stage, replica, step, phase,
cause), reading the errors of stopped actors' calls so that Ray prints none of them, and
``wait_for_origin``: after a call's first failure, how long to wait for the other ranks' errors
before ``blame`` names the rank the failure started at (see ``trainer``'s module docstring).

Invariants:
- Every finished call of a failed step is read, so Ray logs no unread error with its traceback.
- The wait ends when every rank has failed, after ``_FAILURE_GRACE_S`` when the origin is settled,
  and otherwise (``blame.unsettled``) when the silent ranks outlived the last failure by a receive
  timeout and NCCL's debug dump.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import ray
from ray.exceptions import RayError

from raytrain_mp.faults import short_cause
from raytrain_mp.pipeline.blame import Kind, blame, failure_kind, unsettled

# After a rank fails, how long to wait for its peers' errors before naming the origin: a killed
# actor's peer often reports the broken connection before Ray reports the death.
_FAILURE_GRACE_S = 5.0
# How late after a receive times out NCCL's watchdog may tear its process down: it first waits for
# its debug dump (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, 15 s by default).
_WATCHDOG_DUMP_S = 15.0


class StageFailedError(RuntimeError):
    """A stage actor died or raised; ``stage`` is its index (from 0), ``replica`` its replica (None
    with a single one), ``step`` the train step (from 1) it failed in (with several steps a call,
    the first of the call's), or None outside ``train_step``; ``phase`` what the trainer was doing
    ("at step 3", "while starting", "in a balance trial", ...) and ``cause`` why, in a few words
    (``faults.short_cause``)."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        step: int | None,
        cause: BaseException | str,
        replica: int | None = None,
        phase: str | None = None,
    ) -> None:
        self.stage, self.num_stages, self.step, self.replica = stage, num_stages, step, replica
        self.phase = phase or (f"at step {step}" if step is not None else "outside a train step")
        self.cause = cause if isinstance(cause, str) else short_cause(cause)
        of = f" of replica {replica}" if replica is not None else ""
        super().__init__(f"pipeline stage {stage}{of} (of stages 0-{num_stages - 1}) failed {self.phase}: {self.cause}")

    def during(self, phase: str) -> StageFailedError:
        """The same failure, said to have happened ``phase`` (a caller knows better what it was doing)."""
        return StageFailedError(self.stage, self.num_stages, self.step, self.cause, self.replica, phase)


def read_errors(refs: Sequence[ray.ObjectRef], timeout_s: float = 10.0) -> None:
    """Read the calls ``refs`` of stopped actors (they fail at once): a failure the trainer
    handles then leaves no unread error for Ray to print with its traceback when it is freed."""
    if not refs:
        return
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        error_of(ref)


def error_of(ref: ray.ObjectRef) -> RayError | None:
    # Reading every finished result of a failed step, not only the first error, also keeps Ray
    # from logging each unread error object with its traceback when it is freed.
    try:
        ray.get(ref)
    except RayError as error:
        return error
    return None


def wait_for_origin(
    rank_of: dict[ray.ObjectRef, int],
    first: ray.ObjectRef,
    error: RayError,
    pending: list[ray.ObjectRef],
    p2p_timeout_s: float,
    name: Callable[[int], str],
) -> tuple[int, BaseException, list[ray.ObjectRef]]:
    """The origin (``blame.blame``) of a call whose ``first`` ref failed first, with ``error``: (its
    actor's rank, its error, the refs still pending). It waits for the ``pending`` refs first: up
    to ``_FAILURE_GRACE_S`` for their errors, and while the origin is a rank that exited with
    others silent (``blame.unsettled``), until every rank has failed or the silent ones have
    outlived the last failure by a receive timeout (a dead rank's peers fail within one; a hung
    rank, whose waiting peer NCCL's watchdog ended, never fails). ``name(rank)`` words a rank."""
    failures = [(rank_of[first], error)]

    def kinds() -> list[tuple[int, Kind]]:
        return [(rank, failure_kind(failure)) for rank, failure in failures]

    last = time.monotonic()
    grace_end, outlived = last + _FAILURE_GRACE_S, False
    while pending:
        waiting = unsettled(kinds(), [rank_of[ref] for ref in pending])
        deadline = max(grace_end, last + p2p_timeout_s + _WATCHDOG_DUMP_S + _FAILURE_GRACE_S) if waiting else grace_end
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            outlived = waiting
            break
        if (later := error_of(done[0])) is not None:
            failures.append((rank_of[done[0]], later))
            last = time.monotonic()
    index, hung = blame(kinds(), [rank_of[ref] for ref in pending], outlived)
    rank, origin = failures[index]
    if hung is not None:  # its peers waited in vain: name the rank that hangs
        origin = TimeoutError(f"it stopped answering; {name(rank)} gave up waiting for it: {short_cause(origin)}")
        rank = hung
    return rank, origin, pending
