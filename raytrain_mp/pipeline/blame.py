"""Which rank a failed pipeline call names: the pure part of ``trainer``'s failure handling.

Job: from what the driver saw of a failed call (each rank's failure, in the order the failures
came, and the ranks still silent) find the rank the failure started at, without a running Ray or
a process group, so that every case is tested on its own.

A rank's failure is one of four kinds (``failure_kind`` reads it off Ray's error):

- ``died``: its actor died for a reason Ray names (``ray.kill``, its node died, Ray's memory
  monitor killed it).
- ``exited``: its actor's process ended for a reason Ray cannot name ("Worker exit type:
  SYSTEM_ERROR"): a crash, the kernel's OOM killer, or NCCL's watchdog. Where gloo raises when a
  receive times out or a peer's connection breaks, NCCL's watchdog tears the rank's process down
  (SIGABRT) under torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` and under 1; under 2, and
  with ``TORCH_NCCL_BLOCKING_WAIT=1``, the receive raises as on gloo; under 0 it waits forever.
- ``raised``: the rank raised an error of its own.
- ``lost_peer``: the rank raised because a peer stopped answering: a receive timed out or a
  connection closed (a ``DistError``, or gloo's ``RuntimeError`` from its transport).

Invariants:
- The origin is the first failure seen of the lowest order: ``died`` and ``exited`` first, then
  ``raised``, then ``lost_peer``. An exit seen after a ``died``, ``raised`` or ``exited`` failure
  is ``lost_peer``: NCCL's watchdog ended a rank that waited for that one. A ``lost_peer`` seen
  first does not make an exit after it one (on gloo a dead rank's peer often reports the closed
  connection before Ray reports the death).
- When the origin only lost its peer and ranks are silent, the first silent rank is named: it
  stopped answering, and its peers gave up waiting for it.
- A rank that exited while others stay silent either died (its peers, which wait for it, fail
  within a receive timeout of it: ``p2p_timeout_s``) or is NCCL's watchdog ending a rank that
  waited for a silent one that hangs (that one never fails). ``unsettled`` says when the origin
  hinges on this; the driver then waits, and ``outlived=True`` (the silent ranks outlived the last
  failure by a receive timeout) makes every exit ``lost_peer``, so the silent rank is named, as it
  is on gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch.distributed as dist
from ray.exceptions import RayActorError, RayError, RayTaskError

Kind = Literal["died", "exited", "raised", "lost_peer"]
_ORDER: dict[Kind, int] = {"died": 0, "exited": 0, "raised": 1, "lost_peer": 2}
_LOST_PEER = _ORDER["lost_peer"]


class Blame(NamedTuple):
    """``failure``: the index (into the failures) of the origin, or with ``hung`` of the failure
    that gave up waiting for it; ``hung``: the silent rank to name, or None."""

    failure: int
    hung: int | None


def failure_kind(error: RayError) -> Kind:
    """The kind of a rank's failure, from the error ``ray.get`` raised for its call."""
    if isinstance(error, RayActorError):
        # Ray names no reason when the process ended on its own (a signal, a crash, an abort).
        return "exited" if "Worker exit type: SYSTEM_ERROR" in str(error) else "died"
    cause = error.cause if isinstance(error, RayTaskError) else None
    if isinstance(cause, dist.DistError) or (isinstance(cause, RuntimeError) and "gloo/transport" in str(cause)):
        return "lost_peer"
    return "raised"


def blame(failures: Sequence[tuple[int, Kind]], silent: Sequence[int], outlived: bool = False) -> Blame:
    """The origin of a failed call: ``failures`` are (rank, kind) in the order they were seen (at
    least one), ``silent`` the ranks that had not answered when the driver stopped waiting,
    ``outlived`` whether those outlived the last failure by a receive timeout."""
    after_a_failure = outlived and bool(silent)  # every exit then waited in vain for a silent rank
    orders = []
    for _, kind in failures:
        orders.append(_LOST_PEER if kind == "exited" and after_a_failure else _ORDER[kind])
        after_a_failure = after_a_failure or kind != "lost_peer"
    index = min(range(len(failures)), key=orders.__getitem__)  # the first seen among equals
    return Blame(index, silent[0] if silent and orders[index] == _LOST_PEER else None)


def unsettled(failures: Sequence[tuple[int, Kind]], silent: Sequence[int]) -> bool:
    """Whether the origin hinges on whether the ``silent`` ranks hang: it is a rank that exited
    while they stay silent, which NCCL's watchdog does to a rank that waited for a hung one."""
    index, hung = blame(failures, silent)
    return bool(silent) and hung is None and failures[index][1] == "exited"
