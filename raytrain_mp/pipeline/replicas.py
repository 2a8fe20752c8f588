"""Data x pipeline parallelism, the pure part: R pipeline replicas of S stages as one process group.

Job: everything about replicas that needs neither Ray nor a process group, so that it is tested
on its own: the rank layout, how a step's batch is shared among the replicas, which node each
replica's stages go to, and how BatchNorm running statistics updated separately by each replica
combine into the ones a single process would have after all R x m micro-batches.

Invariants:
- Ranks are replica-major: the actor of (replica r, stage s) is global rank ``r * S + s``. Replica
  r's pipeline group is ranks ``r*S .. r*S + S - 1``; stage s's data-parallel group is ranks
  ``s, S + s, ...``. Every rank creates every group in the same order (torch requires it).
- Replica r trains on the r-th contiguous equal share of the batch, so the replicas' micro-batches
  in replica order are the global batch's micro-batches in batch order.
- ``replica_nodes`` spreads replicas over the nodes that can hold a whole replica, fewest replicas
  first; it is a preference for the scheduler, the resource check decides what is possible.
- ``running_stats_weights`` is exact for BatchNorm's update, which is affine in the running
  statistics: a replica's m updates from ``r0`` give ``a * r0 + c_r``; the R x m updates in order
  give ``A * r0 + sum_r w_r * c_r``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from raytrain_mp.errors import OptionError


def check_replicas(num_replicas: int, batch_size: int | None = None, num_microbatches: int = 1) -> None:
    """Raise ``UsageError`` unless ``num_replicas`` is a count of replicas and (when ``batch_size``
    is given) ``num_replicas`` replicas of ``num_microbatches`` equal micro-batches each cut a
    batch of ``batch_size`` samples."""
    if num_replicas < 1 or int(num_replicas) != num_replicas:
        raise OptionError("num_replicas", f"must be a whole number >= 1, got {num_replicas}")
    if batch_size is not None and batch_size % (num_replicas * num_microbatches):
        raise OptionError(
            "num_replicas",
            f"{num_replicas} replicas x {num_microbatches} micro-batches do not divide a batch of "
            f"{batch_size} samples; torch's pipeline runtime needs micro-batches of equal size",
        )


def replica_shares(inputs: Tensor, targets: Tensor, num_replicas: int) -> list[tuple[Tensor, Tensor]]:
    """The replicas' contiguous equal shares of a batch, in replica order."""
    return list(zip(inputs.chunk(num_replicas), targets.chunk(num_replicas)))


def global_rank(replica: int, stage: int, num_stages: int) -> int:
    return replica * num_stages + stage


def replica_and_stage(rank: int, num_stages: int) -> tuple[int, int]:
    """(replica, stage) of global ``rank``: the inverse of ``global_rank``."""
    return divmod(rank, num_stages)


def pipeline_ranks(replica: int, num_stages: int) -> list[int]:
    """The global ranks of replica ``replica``'s stages, in stage order."""
    return [global_rank(replica, stage, num_stages) for stage in range(num_stages)]


def stage_ranks(stage: int, num_replicas: int, num_stages: int) -> list[int]:
    """The global ranks holding stage ``stage``, in replica order (its data-parallel group)."""
    return [global_rank(replica, stage, num_stages) for replica in range(num_replicas)]


def replica_nodes(
    nodes: Mapping[str, Mapping[str, float]], num_replicas: int, bundles: Sequence[Mapping[str, float]]
) -> list[str | None]:
    """A node id per replica that can hold all its stages' ``bundles``, the replicas spread over
    as many nodes as can hold one (``nodes``: id -> total resources); None where none is left."""
    need = replica_resources(bundles)
    room = {
        node: min(int(have.get(key, 0) // amount) for key, amount in need.items() if amount)
        for node, have in nodes.items()
    }
    placed = dict.fromkeys(nodes, 0)
    chosen: list[str | None] = []
    for _ in range(num_replicas):
        fits = [node for node in nodes if room[node] >= 1]
        if not fits:
            chosen.append(None)
            continue
        node = min(fits, key=lambda n: (placed[n], -room[n]))
        room[node] -= 1
        placed[node] += 1
        chosen.append(node)
    return chosen


def replica_resources(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """What one replica's stage ``bundles`` need together."""
    return {key: sum(bundle.get(key, 0) for bundle in bundles) for key in dict.fromkeys(k for b in bundles for k in b)}


def running_stats_weights(
    momentum: float | None, tracked: int, num_microbatches: int, num_replicas: int, replica: int
) -> tuple[float, float, float]:
    """(a, w, A) for one replica's BatchNorm running statistics after ``num_microbatches`` updates
    from ``r0`` with ``tracked`` batches counted before: the replica's own contribution is
    ``c = r - a * r0``, and the statistics after all replicas' updates in order are
    ``A * r0 + sum over replicas of w * c``. ``momentum`` None is BatchNorm's cumulative average."""
    m, total = num_microbatches, num_microbatches * num_replicas
    if momentum is None:  # r = (tracked * r0 + sum of batch statistics) / (tracked + updates)
        return tracked / (tracked + m), (tracked + m) / (tracked + total), tracked / (tracked + total)
    keep = 1.0 - momentum
    return keep**m, keep ** (m * (num_replicas - 1 - replica)), keep**total
