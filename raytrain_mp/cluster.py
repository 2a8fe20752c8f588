"""Connecting to Ray and checking that a job's resource request fits, before anything is scheduled.

Invariants: an explicit ``--address`` (or ``RAY_ADDRESS``, as ``ray job submit`` sets it) joins that
cluster; otherwise a local Ray is started with this machine's CPUs and GPUs and shut down by the
caller that started it. A request larger than the cluster is a ``UsageError`` naming the option,
raised before any actor or worker starts (a Ray Train or Tune job would otherwise wait forever).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from collections.abc import Iterator

import ray

from raytrain_mp.errors import UsageError


@contextmanager
def ray_connection(address: str | None) -> Iterator[bool]:
    """Yield True when this call started (and will stop) a local Ray instance."""
    if ray.is_initialized():
        yield False
        return
    address = address or os.environ.get("RAY_ADDRESS")
    quiet_ray_train_logs()
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # The dashboard is where users watch a local run, and Ray Train's placement-group cleaner
        # polls the state API it serves (without it, a warning every second).
        ray.init(num_cpus=os.cpu_count(), include_dashboard=True, log_to_driver=True)
    try:
        yield not address
    finally:
        if not address:
            ray.shutdown()


def quiet_ray_train_logs() -> None:
    """Our rank-0 progress lines are the progress; Ray Train's print patch would echo each twice
    and its per-report log line repeats every metric. Users can set the variables to override."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING", "0")


def cluster_totals() -> tuple[float, float]:
    """(CPUs, GPUs) of the whole cluster."""
    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


def resolve_use_gpu(use_gpu: bool | None) -> bool:
    """``--use-gpu`` as given, else True when the cluster has at least one GPU."""
    return cluster_totals()[1] >= 1 if use_gpu is None else use_gpu


def check_fits(count_option: str, count: int, cpus_each: float, gpus_each: float) -> None:
    """Raise a UsageError when ``count`` units of (cpus_each, gpus_each) exceed the cluster."""
    cpus, gpus = cluster_totals()
    if count * cpus_each > cpus:
        raise UsageError(
            f"{count_option} {count} needs {count * cpus_each:g} CPUs but the Ray cluster has {cpus:g}; "
            f"accepted: at most {int(cpus // cpus_each)}"
        )
    if count * gpus_each > gpus:
        raise UsageError(
            f"{count_option} {count} needs {count * gpus_each:g} GPUs but the Ray cluster has {gpus:g}; "
            f"accepted: at most {int(gpus // gpus_each)} with --use-gpu, or --no-use-gpu"
        )
