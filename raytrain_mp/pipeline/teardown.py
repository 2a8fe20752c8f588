"""Stopping stage actors: return only once they are dead, so what they held is free.

Job: ``stop_actors`` kills actors and waits, bounded, until each is dead. ``ray.kill`` only asks:
it returns while the actor may still run, hold its GPU's memory and CPUs, and answer calls. A
caller that goes on to start what needs those (the next balance trial's stages, the bench's
torchrun peer on the same GPUs) or expects the next call to fail must wait.

Invariants:
- An actor counts as dead once a call to it raises ``ActorDiedError`` (not the transient
  ``ActorUnavailableError``); an actor that was never scheduled or had died already is dead at once.
- The wait is bounded (``timeout_s`` over all the actors): one that still answers then is
  returned, with a warning, never waited on for ever, and never raised on (a caller stopping the
  ranks of a failed step must still report the failure).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

STOP_TIMEOUT_S = 60.0
_POLL_S = 0.05


def stop_actors(actors: Sequence[Any], timeout_s: float = STOP_TIMEOUT_S) -> list[Any]:
    """``ray.kill`` every actor of ``actors`` (handles), then wait up to ``timeout_s`` in all until
    each is dead. Returns those still alive then (empty when all died), after warning."""
    for actor in actors:
        ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    alive = list(actors)
    while alive and time.monotonic() < deadline:
        alive = [actor for actor in alive if _answers(actor, deadline - time.monotonic())]
        if alive:
            time.sleep(_POLL_S)
    if alive:
        warnings.warn(
            f"{len(alive)} of {len(actors)} actors still answered {timeout_s:.0f} s after ray.kill", stacklevel=2
        )
    return alive


def _answers(actor: Any, timeout_s: float) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=max(timeout_s, 0.0))
    except ActorDiedError:
        return False
    except (ActorUnavailableError, GetTimeoutError):
        pass  # neither dead nor answering yet: it may still hold what it held
    return True
