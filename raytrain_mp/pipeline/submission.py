"""The trainer's submission queue: train-step calls to the stage actors, some queued behind the running one.

Job: ``StepQueue`` sends one ``train_steps`` call per actor for a chunk of consecutive steps
(``steps_per_call``), keeps up to ``ahead`` calls waiting behind the running one, and on each
call's end records its steps' timing (``stats.StepTimes``), counts them done and returns their
losses.

Invariants:
- The actors run their calls in order, so the steps are those of ``train_step`` one by one, and
  step numbers count on from ``steps_done`` across calls still in flight.
- Every submitted step runs: closing the iterator early still waits for the queued ones; after a
  failure the queued calls' errors are read, so Ray prints none.
- A call's time counts from when the ranks could start it (its submission, or the end of the call
  before it when that came later), shared evenly by its steps.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray

from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline.actors import StageActors
from raytrain_mp.pipeline.failures import read_errors
from raytrain_mp.pipeline.replicas import global_rank
from raytrain_mp.pipeline.schedule import Schedule
from raytrain_mp.pipeline.stats import StepTimes

# A submitted call: (first step number, (actor index, ref) per actor, when submitted, steps).
Call = tuple[int, list[tuple[int, ray.ObjectRef]], float, int]
# (replica, rank) -> that actor's (inputs, targets, positions) of a call.
Payload = Callable[[int, int], tuple[Any, Any, Any]]


class StepQueue:
    """Train-step calls to ``stages``, timed into ``times``."""

    def __init__(self, stages: StageActors, times: StepTimes) -> None:
        self.stages, self.times = stages, times
        self.steps_done = 0  # train steps completed; the CLI sets it when resuming
        self._queued = 0  # steps submitted and not yet finished
        self._last_finish = 0.0

    def run(
        self, items: Iterable[Any], submit: Callable[[list[Any]], Call], ahead: int, steps_per_call: int
    ) -> Iterator[float]:
        """Each step's loss, in order, of ``items`` handed ``steps_per_call`` at a time to ``submit``."""
        if steps_per_call < 1 or ahead < 0:
            raise UsageError(f"steps_per_call must be >= 1 and ahead >= 0, got {steps_per_call} and {ahead}")
        items = iter(items)
        queued: deque[Call] = deque()
        try:
            while chunk := list(itertools.islice(items, steps_per_call)):
                queued.append(submit(chunk))
                if len(queued) > ahead:
                    yield from self.finish(*queued.popleft())
            while queued:
                yield from self.finish(*queued.popleft())
        finally:
            while queued and self.stages.actors:
                self.finish(*queued.popleft())
            # After a failure the actors are gone: the calls queued behind it failed with them.
            read_errors([ref for _, refs, _, _ in queued for _, ref in refs])

    def send(
        self,
        schedule: Schedule,
        num_microbatches: int,
        clip_grad_norm: float | None,
        shape: tuple[int, ...],
        lrs: list[float | None],
        payload: Payload,
    ) -> Call:
        """One ``train_steps`` call per actor for the steps of ``lrs``, with ``payload(replica,
        rank)``'s (inputs, targets, positions)."""
        stages = self.stages
        submitted = time.perf_counter()
        refs = []
        for replica in range(stages.num_replicas):
            for rank in range(stages.num_stages):
                inputs, targets, positions = payload(replica, rank)
                call = stages.actor(rank, replica).train_steps.remote(  # the entry itself: a test's reaches the actors
                    schedule,
                    num_microbatches,
                    shape,
                    inputs,
                    targets,
                    clip_grad_norm,
                    lrs,
                    positions,
                )
                refs.append((global_rank(replica, rank, stages.num_stages), call))
        first = self.steps_done + self._queued + 1
        self._queued += len(lrs)
        return first, refs, submitted, len(lrs)

    def finish(self, first: int, refs: list[tuple[int, ray.ObjectRef]], submitted: float, steps: int) -> list[float]:
        """Wait for a submitted call and return its steps' losses. Its time counts from when the
        ranks could start it (its submission, or the end of the call before it when that came
        later), shared evenly by its steps, and is at least what its slowest rank took inside: a
        driver that sees a call end late (descheduled on a loaded machine) would otherwise give
        the call queued behind it less time than its ranks spent, and a negative bubble."""
        results = self.stages.gather(refs, first)  # per actor, a (loss, busy, forward busy, took) per step
        now = time.perf_counter()
        wall = (now - max(submitted, self._last_finish)) / steps
        for i in range(steps):
            in_ranks = max(actor[i][3] for actor in results)
            self.times.record(
                max(wall, in_ranks), [actor[i][1] for actor in results], [actor[i][2] for actor in results], in_ranks
            )
        self._last_finish = now
        self._queued -= steps
        self.steps_done = first + steps - 1
        # Each replica's last rank returns its share of the global batch mean.
        num_stages = self.stages.num_stages
        return [sum(actor[i][0] for actor in results[num_stages - 1 :: num_stages]) for i in range(steps)]
