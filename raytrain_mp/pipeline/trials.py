"""Balance by time: the profile of the blocks on a rank's device, the cut it gives, and the balance
trials that correct it by what running stages measure.

Job: ``profile`` times every block on the device rank 0 will run on (a task in rank 0's bundle,
before its actor takes it); ``time_cut`` balances the blocks' seconds for the schedule;
``fastest_cut`` runs cuts on stage actors of their own (one untimed step, N timed ones), rescales
the profile to what each rank measured per micro-batch and cuts anew, up to ``TRIAL_CUTS`` cuts,
recording a ``BalanceTrial`` for each; the cut with the least median bubble stays.

Invariants:
- The blocks and so the work are the same on every cut, so the least waiting is the shortest
  step, and a share of a step's time does not drift with a shared machine's speed as seconds do.
- A trial leaves the trainer as it found it: no actors running, no steps counted.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import RayError
from torch import Tensor, nn

from raytrain_mp.pipeline.blocks import Block
from raytrain_mp.pipeline.failures import StageFailedError
from raytrain_mp.pipeline.partition import balance_bounds, balance_fill_drain_bounds, cut_score, rescale_to_measured
from raytrain_mp.pipeline.stage_config import StageConfig, profile_on_stage_device
from raytrain_mp.pipeline.stats import StepStats

if TYPE_CHECKING:  # only for annotations: trials run on the trainer they are given
    from raytrain_mp.pipeline.actors import StageActors

TRIAL_CUTS = 3  # balance_trials: the most cuts run on the stage actors, the profile's own included


@dataclasses.dataclass(frozen=True)
class BalanceTrial:
    """One cut run on the stage actors (an entry of ``PipelineTrainer.balance_trials``)."""

    split_points: list[str]
    profile_score: float
    forward_seconds: list[float]  # per rank and micro-batch
    backward_seconds: list[float]  # the same, with the optimizer step's share
    bubble_fraction: float
    seconds_per_step: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def profile(
    stages: StageActors, model: nn.Module, blocks: list[Block], sample: Tensor, config: StageConfig
) -> list[tuple[float, float]]:
    """Per block, its (forward, backward) seconds on ``sample``, timed where rank 0 will run."""
    # Profile where rank 0 will run, before its actor takes the bundle: the target device.
    # max_calls=1: the task's worker exits afterwards, so it holds no CUDA context on the GPU and its
    # allocator settings (allocator.keep_freed_memory) die with it.
    task = ray.remote(max_calls=1)(profile_on_stage_device).options(**stages.placement(0))
    try:
        return ray.get(
            task.remote(
                model, blocks, sample, stages.use_gpu, config.num_cpus, config.autocast_bf16, config.memory_format
            )
        )
    except RayError as error:  # its process or node lost, as a stage actor's can be
        raise StageFailedError(0, stages.num_stages, None, error, phase="while profiling its blocks") from error


def time_cut(forward: Sequence[float], backward: Sequence[float], parts: int, fill_drain: bool) -> list[int]:
    """Time balance of blocks with these seconds into ``parts``: GPipe's step (``fill_drain``) pays
    its slowest stage's forward and its slowest stage's backward (``balance_fill_drain_bounds``);
    the other schedules alternate the two phases. (``set_schedule`` refuses GPipe with virtual
    stages.)"""
    if fill_drain:
        return balance_fill_drain_bounds(forward, backward, parts)
    return balance_bounds([f + b for f, b in zip(forward, backward)], parts)


def per_rank_and_microbatch(
    timed: Sequence[StepStats], key: str, ranks: int, num_replicas: int, num_microbatches: int
) -> list[float]:
    """Per rank, its median seconds ``key`` over the ``timed`` steps' stats per micro-batch, the
    replicas' mean."""
    return [
        statistics.mean(
            statistics.median(getattr(stats, key)[actor] for stats in timed)
            for actor in range(rank, ranks * num_replicas, ranks)
        )
        / num_microbatches
        for rank in range(ranks)
    ]


def fastest_cut(
    trainer: Any,
    model: nn.Module,
    blocks: list[Block],
    template: StageConfig,
    bounds: list[int],
    forward: list[float],
    backward: list[float],
    sample: Tensor,
    steps: int,
    fill_drain: bool,
) -> tuple[list[int], list[BalanceTrial]]:
    """Run ``bounds`` on ``trainer``'s stage actors of its own (one untimed step of ``sample``,
    ``steps`` timed ones), rescale the profile to what each rank measured per micro-batch, cut
    anew, and repeat while the cut is new and fewer than ``TRIAL_CUTS`` have run: the cut with the
    least median bubble, and every cut run. ``trainer`` is a ``PipelineTrainer`` that has reserved
    its placement groups and started no stages."""
    names = [block.name for block in blocks]
    targets = torch.zeros(len(sample), dtype=torch.long)  # any class will do: only the time counts
    ranks = trainer.num_stages
    parts = ranks * trainer.virtual_stages
    tried: list[list[int]] = []
    trials: list[BalanceTrial] = []
    trainer.stats(reset=True)
    while bounds not in tried and len(tried) < TRIAL_CUTS:
        trainer.start_stages(model, blocks, bounds, template)
        trainer.train_step(sample, targets)
        trainer.stats(reset=True)
        timed = []
        for _ in range(steps):
            trainer.train_step(sample, targets)
            timed.append(trainer.stats(reset=True))
        trainer.stop_stages()
        tried.append(bounds)
        shape = (ranks, trainer.num_replicas, trainer.num_microbatches)
        measured_forward = per_rank_and_microbatch(timed, "forward_busy_seconds", *shape)
        busy = per_rank_and_microbatch(timed, "busy_seconds", *shape)
        measured_backward = [b - f for b, f in zip(busy, measured_forward)]
        trials.append(
            BalanceTrial(
                split_points=[names[i] for i in bounds[1:-1]],
                profile_score=cut_score(forward, backward, bounds, fill_drain),
                forward_seconds=measured_forward,
                backward_seconds=measured_backward,
                bubble_fraction=statistics.median(t.bubble_fraction for t in timed),
                seconds_per_step=statistics.median(t.seconds_per_step for t in timed),
            )
        )
        bounds = time_cut(
            rescale_to_measured(forward, bounds, ranks, measured_forward),
            rescale_to_measured(backward, bounds, ranks, measured_backward),
            parts,
            fill_drain,
        )
    trainer.steps_done = 0
    return min(tried, key=lambda cut: trials[tried.index(cut)].bubble_fraction), trials
