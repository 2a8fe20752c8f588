"""Where the stage actors go: joining Ray, the stages' bundles, the resource check and the placement groups.

Job: join (or start) Ray, size one bundle per stage (CPUs, a GPU, the first stage's loader
processes), let an autoscaling cluster add nodes, refuse what the alive nodes can never hold
(``check_resources``), and reserve one placement group per replica under the strategy; then say
where an actor of a (replica, stage) is scheduled.

Invariants:
- Every refusal is a ``UsageError`` raised before any placement group exists.
- Only STRICT_PACK takes a target node per replica: the replicas spread over the nodes that can
  hold one (``replicas.replica_nodes``), a hint Ray may still pack.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_mp.cluster import reachable, resolve_use_gpu, use_token_if_the_cluster_asks, wait_for_autoscaler
from raytrain_mp.errors import OptionError
from raytrain_mp.pipeline.layouts import PLACEMENT_STRATEGIES
from raytrain_mp.pipeline.replicas import replica_nodes, replica_resources

_PLACEMENT_TIMEOUT_S = 120.0


def check_resources(
    nodes: Sequence[Mapping[str, float]],
    bundles: Sequence[Mapping[str, float]],
    strategy: str,
    num_replicas: int = 1,
) -> None:
    """Raise ``UsageError`` when the alive ``nodes`` (their total resources) can never hold
    ``num_replicas`` placement groups of the stages' ``bundles`` (one per stage, in order) under
    ``strategy``."""
    if strategy not in PLACEMENT_STRATEGIES:
        raise OptionError(
            "placement_strategy", f"unknown strategy {strategy!r}; accepted: {', '.join(PLACEMENT_STRATEGIES)}"
        )
    num_stages = len(bundles)
    what = f"{num_replicas} replicas x {num_stages} stages" if num_replicas > 1 else f"{num_stages} stages"
    need = replica_resources(bundles)
    for resource, amount in need.items():
        have = sum(node.get(resource, 0) for node in nodes)
        if have < num_replicas * amount:
            option = "use_gpu" if resource == "GPU" else "cpus_per_stage"
            amounts = [bundle.get(resource, 0) for bundle in bundles]
            each = (
                f"{amounts[0]:g} each"
                if len(set(amounts)) == 1
                else (
                    f"{'/'.join(f'{a:g}' for a in amounts)} by stage: the first stage's loader processes "
                    "(data.loader_workers) count"
                )
            )
            raise OptionError(
                option,
                f"{what} need {num_replicas * amount:g} {resource} ({each}); the Ray cluster has {have:g}",
                mentions=("data.loader_workers",),
            )

    def fits(node: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
        return all(node.get(resource, 0) >= amount for resource, amount in bundle.items())

    shown = (
        dict(bundles[0]) if all(bundle == bundles[0] for bundle in bundles) else [dict(bundle) for bundle in bundles]
    )
    each = "each" if isinstance(shown, dict) else "by stage"
    if strategy == "STRICT_PACK" and not any(fits(node, need) for node in nodes):
        raise OptionError(
            "placement_strategy",
            f"STRICT_PACK needs one node that holds all {num_stages} stages "
            f"({shown} {each}) and no node does; use PACK or SPREAD",
        )
    packed = replica_nodes({str(i): node for i, node in enumerate(nodes)}, num_replicas, bundles)
    if strategy == "STRICT_PACK" and None in packed:
        raise OptionError(
            "placement_strategy",
            f"STRICT_PACK needs a node per replica that holds all its {num_stages} stages "
            f"({shown} {each}); the nodes hold {packed.index(None)} of {num_replicas} replicas; use PACK or SPREAD",
        )
    free = list(nodes)
    for bundle in sorted(bundles, key=lambda b: -sum(b.values())) if strategy == "STRICT_SPREAD" else ():
        node = next((node for node in free if fits(node, bundle)), None)
        if node is None:
            one = "one stage" if isinstance(shown, dict) else "one stage each"
            raise OptionError(
                "placement_strategy",
                f"STRICT_SPREAD needs {num_stages} nodes that each hold {one} ({shown}); use SPREAD or PACK",
            )
        free.remove(node)


def join_ray() -> None:
    """When Ray is not initialized yet, join ``RAY_ADDRESS`` if set (one error line if nothing
    answers there) and otherwise start a new local Ray instance."""
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        joined = reachable(address, "RAY_ADDRESS") if address else "local"
        if address:
            use_token_if_the_cluster_asks(joined)
        ray.init(address=joined)


def alive_nodes() -> dict[str, dict[str, float]]:
    """Node id -> total resources of each alive node."""
    return {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}


def reserve(
    num_stages: int,
    num_replicas: int,
    use_gpu: bool | None,
    cpus_per_stage: int,
    loader_workers: int,
    strategy: str,
) -> tuple[bool, list[dict[str, float]], dict[str, dict[str, float]]]:
    """Join Ray and check that the cluster can hold the stages: (use_gpu resolved, one bundle per
    stage, the alive nodes' resources). The first stage's bundle also reserves a CPU for each of
    its ``loader_workers``."""
    join_ray()
    alive = alive_nodes()
    use_gpu = resolve_use_gpu(use_gpu, num_replicas * num_stages, "stage actors")
    bundle = {"CPU": cpus_per_stage, **({"GPU": 1} if use_gpu else {})}
    bundles = [{**bundle, "CPU": cpus_per_stage + loader_workers * (rank == 0)} for rank in range(num_stages)]
    if wait_for_autoscaler(f"{num_replicas * num_stages} stage actors", bundles * num_replicas):
        alive = alive_nodes()  # with the nodes it added
    check_resources(list(alive.values()), bundles, strategy, num_replicas)
    return use_gpu, bundles, alive


def placement_groups(
    alive: Mapping[str, Mapping[str, float]], bundles: Sequence[Mapping[str, float]], strategy: str, num_replicas: int
) -> list[PlacementGroup]:
    """One placement group of ``bundles`` per replica (not waited for: ``wait_for_placement``)."""
    # Only STRICT_PACK takes a target node; it spreads the replicas (a hint: Ray may still pack them).
    targets = replica_nodes(alive, num_replicas, bundles) if num_replicas > 1 else [None]
    hints = targets if strategy == "STRICT_PACK" else [None] * num_replicas
    return [placement_group([dict(b) for b in bundles], strategy=strategy, _soft_target_node_id=hint) for hint in hints]


def wait_for_placement(pgs: Sequence[PlacementGroup], bundles: Sequence[Mapping[str, float]], strategy: str) -> None:
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_PLACEMENT_TIMEOUT_S)
    if len(ready) < len(refs):
        groups = f"{len(pgs)} placement groups" if len(pgs) > 1 else "placement group"
        raise RuntimeError(
            f"{groups} of {list(bundles)} ({strategy}) was not ready after "
            f"{_PLACEMENT_TIMEOUT_S:g} s; other jobs may hold the resources"
        )


def placement(
    pgs: Sequence[PlacementGroup], bundles: Sequence[Mapping[str, float]], use_gpu: bool, index: int, replica: int = 0
) -> dict[str, Any]:
    """The Ray options of the actor (or task) of stage ``index`` of ``replica``: its bundle."""
    return {
        "num_cpus": bundles[index]["CPU"],
        "num_gpus": 1 if use_gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pgs[replica], placement_group_bundle_index=index),
    }


def node_ids(pgs: Sequence[PlacementGroup], num_stages: int) -> list[str]:
    """The Ray node id of every (replica, stage), replica-major."""
    return [ray.util.placement_group_table(pg)["bundles_to_node_id"][rank] for pg in pgs for rank in range(num_stages)]
