"""The stage actors of a trainer: their placement groups, their handles, calls to them, and stopping them.

Job: ``StageActors`` holds one actor per (replica, stage), replica-major (actor ``r * num_stages
+ s`` is stage s of replica r), in the placement groups reserved for them (``placement``); it
starts them, calls a method on all of them or on one replica's, gathers the results, and on a
failure stops every rank and raises ``StageFailedError`` for the origin (``failures``).

Invariants:
- After a failure or ``shutdown`` no actor is left, and any later use raises, saying why.
- Stopped means dead, not only asked to die: what comes next (the next balance trial's stages,
  a bench's torchrun peer) needs the GPUs and CPUs they held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from torch import nn

from raytrain_mp.pipeline.failures import StageFailedError, read_errors, wait_for_origin
from raytrain_mp.pipeline.placement import placement, wait_for_placement
from raytrain_mp.pipeline.replicas import global_rank, replica_and_stage
from raytrain_mp.pipeline.stage import StageConfig, StageWorker
from raytrain_mp.pipeline.teardown import stop_actors


class StageActors:
    """The actors of ``num_replicas`` pipelines of ``num_stages`` stages in the placement groups
    ``pgs`` (one per replica) of ``bundles`` (one per stage)."""

    def __init__(
        self,
        num_stages: int,
        num_replicas: int,
        use_gpu: bool,
        bundles: Sequence[Mapping[str, float]],
        pgs: Sequence[PlacementGroup],
        p2p_timeout_s: float,
    ) -> None:
        self.num_stages, self.num_replicas, self.use_gpu = num_stages, num_replicas, use_gpu
        self.bundles, self.pgs, self.p2p_timeout_s = list(bundles), list(pgs), p2p_timeout_s
        self.actors: list[Any] = []
        self.stopped = "shutdown(), which stopped its stage actors"

    def wait_for_placement(self, strategy: str) -> None:
        wait_for_placement(self.pgs, self.bundles, strategy)

    def placement(self, index: int, replica: int = 0) -> dict[str, Any]:
        """The Ray options of stage ``index`` of ``replica``'s actor (or a task in its bundle)."""
        return placement(self.pgs, self.bundles, self.use_gpu, index, replica)

    def start(self, held: Sequence[Sequence[nn.Module]], template: StageConfig) -> None:
        """One actor per rank of every replica, holding its modules ``held[rank]`` (not yet ready)."""
        actor_class = ray.remote(StageWorker)
        for replica in range(self.num_replicas):
            for rank, modules in enumerate(held):
                config = dataclasses.replace(template, rank=rank, replica=replica)
                options = self.placement(rank, replica)
                self.actors.append(actor_class.options(**options).remote(modules, config))

    def all_actors(self) -> list[Any]:
        self.actor(0)  # raises once stopped
        return self.actors

    def actor(self, stage: int, replica: int = 0) -> Any:
        """The Ray actor handle of ``stage`` of ``replica`` (for inspection and fault injection)."""
        if not self.actors:
            raise RuntimeError(f"PipelineTrainer: used after {self.stopped}; build a new PipelineTrainer")
        return self.actors[global_rank(replica, stage, self.num_stages)]

    def call_all(self, method: str, *args: Any, phase: str | None = None) -> list[Any]:
        """``method(*args)`` on every actor of every replica; the results, replica-major. A failure
        says it happened ``phase``."""
        refs = [(index, getattr(actor, method).remote(*args)) for index, actor in enumerate(self.all_actors())]
        return self.gather(refs, step=None, phase=phase)

    def replica_calls(
        self, replica: int, method: str, args_of_rank: Sequence[tuple] | None = None, phase: str | None = None
    ) -> list[Any]:
        """``method`` on each stage of ``replica`` (with ``args_of_rank[rank]``); the results in
        stage order. A failure says it happened ``phase``."""
        refs = [
            (
                global_rank(replica, rank, self.num_stages),
                getattr(self.actor(rank, replica), method).remote(*(args_of_rank[rank] if args_of_rank else ())),
            )
            for rank in range(self.num_stages)
        ]
        return self.gather(refs, step=None, phase=phase)

    def gather(
        self, submitted: list[tuple[int, ray.ObjectRef]], step: int | None, phase: str | None = None
    ) -> list[Any]:
        """The results of ``submitted`` (actor index, ref) pairs, in order. A failure stops every
        rank and raises ``StageFailedError`` for its origin (see ``trainer``'s module docstring), at
        ``step`` or ``phase``."""
        refs = [ref for _, ref in submitted]
        results: dict[ray.ObjectRef, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[done[0]] = ray.get(done[0])
                continue
            except RayError as error:
                failed = error  # raised outside the handler, so that Ray's error is not its context
            self.fail(submitted, done[0], failed, pending, step, phase)
        return [results[ref] for ref in refs]

    def fail(
        self,
        submitted: list[tuple[int, ray.ObjectRef]],
        first: ray.ObjectRef,
        error: RayError,
        pending: list[ray.ObjectRef],
        step: int | None,
        phase: str | None = None,
    ) -> NoReturn:
        """Stop every rank and raise ``StageFailedError`` for the origin (``failures.wait_for_origin``)
        of a call whose ``first`` ref failed first, with ``error``."""
        rank_of = {ref: rank for rank, ref in submitted}
        rank, origin, pending = wait_for_origin(
            rank_of, first, error, pending, self.p2p_timeout_s, lambda rank: self.name(rank)[2]
        )
        self.shutdown()
        read_errors(pending)
        stage, replica, name = self.name(rank)
        self.stopped = f"a failure of {name}, after which it stopped every stage actor"
        raise StageFailedError(stage, self.num_stages, step, origin, replica, phase) from origin

    def name(self, rank: int) -> tuple[int, int | None, str]:
        """(stage, replica or None with a single one, "stage S[ of replica R]") of actor ``rank``."""
        replica, stage = replica_and_stage(rank, self.num_stages)
        if self.num_replicas == 1:
            return stage, None, f"stage {stage}"
        return stage, replica, f"stage {stage} of replica {replica}"

    def stop(self) -> None:
        """Stop the actors, keeping the placement groups (a balance trial starts others in them)."""
        stop_actors(self.actors)
        self.actors = []

    def shutdown(self) -> None:
        """Stop the stage actors and free their placement groups (safe to call twice)."""
        self.stop()
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []
