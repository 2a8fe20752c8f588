"""The timing of a trainer's steps: ``StepStats`` (what ``PipelineTrainer.stats`` returns) and the
running sums it is made of.

Job: add each finished step's wall time, each actor's busy seconds and the longest time a rank's
step call took inside the rank, and turn the sums into per-step figures and the bubble fraction.
Pure: no Ray.

Invariants:
- ``bubble_fraction`` is ``1 - sum(busy) / (actors * wall_seconds)``, 0 without steps.
- ``StepStats``' field names are the keys of its dict form (``as_dict``), which the JSON outputs of
  the run and the benchmarks carry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from raytrain_mp.pipeline.schedule import stage_times_bubble


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Timing of the train steps since the last reset.

    ``busy_seconds[i]``: seconds actor i (stage i % S of replica i // S) computed (forwards, backwards,
    optimizer step); ``forward_busy_seconds[i]``: of those, its forwards'.
    ``bubble_fraction``: ``1 - sum(busy) / (actors * wall_seconds)``, the share of the actors' time
    spent waiting — pipeline fill and drain, transfers, the replicas' all-reduces, Ray and driver
    overhead.
    ``rank_seconds_per_step``: the longest time a rank's step call took inside the rank, what a
    torchrun script would time; ``seconds_per_step`` minus this is the Ray call's cost.
    """

    steps: int
    wall_seconds: float
    seconds_per_step: float
    rank_seconds_per_step: float
    busy_seconds: list[float]
    forward_busy_seconds: list[float]
    bubble_fraction: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StepTimes:
    """The running sums behind ``StepStats``, for ``num_actors`` actors."""

    def __init__(self, num_actors: int) -> None:
        self.num_actors = num_actors
        self.reset()

    def reset(self) -> None:
        self._wall = 0.0
        self._in_ranks = 0.0
        self._steps = 0
        self._busy = [0.0] * self.num_actors
        self._forward_busy = [0.0] * self.num_actors

    def record(self, wall: float, busy: Sequence[float], forward_busy: Sequence[float], in_ranks: float) -> None:
        self._wall += wall
        self._in_ranks += in_ranks
        self._steps += 1
        self._busy = [total + seconds for total, seconds in zip(self._busy, busy)]
        self._forward_busy = [total + seconds for total, seconds in zip(self._forward_busy, forward_busy)]

    def stats(self) -> StepStats:
        wall = self._wall
        return StepStats(
            steps=self._steps,
            wall_seconds=wall,
            seconds_per_step=wall / self._steps if self._steps else 0.0,
            rank_seconds_per_step=self._in_ranks / self._steps if self._steps else 0.0,
            busy_seconds=list(self._busy),
            forward_busy_seconds=list(self._forward_busy),
            bubble_fraction=1 - sum(self._busy) / (len(self._busy) * wall) if wall > 0 else 0.0,
        )


def stage_time_metrics(stats: StepStats, schedule: str, stages: int, microbatches: int) -> dict:
    """Each rank's computing seconds per step (the first replica's), and for the flat schedules the
    bubble those stage times alone would leave (``schedule.bubble_for_stage_times``): the measured
    bubble minus it is what transfers and calls cost, the rest is the cut's imbalance."""
    steps = max(stats.steps, 1)
    busy, forward = stats.busy_seconds[:stages], stats.forward_busy_seconds[:stages]
    metrics = {"stage_seconds_per_step": [seconds / steps for seconds in busy]}
    predicted = stage_times_bubble(schedule, busy, microbatches, forward) if stats.steps else None
    if predicted is not None:  # fill-drain schedules count their phases apart
        metrics["bubble_for_stage_times"] = predicted
    return metrics


def describe_stage_times(metrics: dict) -> str:
    """The epoch line's account of ``stage_time_metrics``."""
    seconds = "/".join(f"{s:.3f}" for s in metrics["stage_seconds_per_step"])
    predicted = metrics.get("bubble_for_stage_times")
    return f" (stage times {seconds} s/step" + (
        f", which predict bubble {predicted:.3f})" if predicted is not None else ")"
    )
