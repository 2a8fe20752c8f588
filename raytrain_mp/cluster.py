"""Connecting to Ray and checking that a job's resource request fits, before anything is scheduled.

Invariants: an explicit ``--address`` (or ``RAY_ADDRESS``, as ``ray job submit`` sets it) joins that
cluster, after a probe that answers within ``CONNECT_TIMEOUT_S`` (an unreachable address is one
``UsageError`` line, never Ray's minutes of retries); otherwise a new local Ray is started
(``address="local"``, whatever a stale ``ray start`` left in Ray's temp dir) with this machine's
CPUs and GPUs and shut down by the caller that started it. A request larger than the cluster is a ``UsageError`` naming the option,
raised before any actor or worker starts (a Ray Train or Tune job would otherwise wait forever).

Quiet by default: the terminal shows the commands' own lines and Ray's warnings and errors; Ray's
informational lines (and the known-harmless notices in ``HARMLESS_NOTICES``) stay in Ray's log
files, and ``verbose`` brings them back. This is done with Ray's and Python's logging settings
(the driver's ``logging_level``, Ray Train's ``LoggingConfig``), never by filtering output text.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import ray

from raytrain_mp.errors import UsageError
from raytrain_mp.interruption import rearm

# (logger, message start) of notices that say nothing a user must act on here: a locally started
# Ray enables token authentication by itself and says so at WARNING on every start.
HARMLESS_NOTICES = (("ray._private.authentication.authentication_token_setup", "Token authentication is enabled"),)


@contextmanager
def environment(updates: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``updates`` while the block runs, as it was afterwards: Ray hands the
    driver's environment to the processes it starts then (Ray's own, or Ray Train's controller)."""
    previous = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def ray_connection(address: str | None, verbose: bool = False, quiet: bool = False) -> Iterator[bool]:
    """Yield True when this call started (and will stop, also on an exception) a local Ray
    instance; ``quiet``: without the line that says so."""
    if ray.is_initialized():
        yield False
        return
    address = address or os.environ.get("RAY_ADDRESS")
    quiet_ray_train_logs()
    if not verbose:
        silence_harmless_notices()
    # The driver's Ray logger, and the root and Ray loggers of every task and actor of this job.
    level = "INFO" if verbose else "WARNING"
    logs = dict(log_to_driver=True, logging_level=level, logging_config=ray.LoggingConfig(encoding="TEXT", log_level=level))
    if address:
        joined = reachable(address)
        use_token_if_the_cluster_asks(joined)
        try:
            ray.init(address=joined, **logs)
        except ConnectionError as exc:  # a token-authenticated cluster refusing this client, most often
            reason = " ".join(str(exc).split())
            raise UsageError(
                f"--address: Ray at {joined} refused this client: {reason}; a cluster started with token "
                "authentication needs its token here (~/.ray/auth_token, or RAY_AUTH_TOKEN) and RAY_AUTH_MODE=token"
            ) from None
    else:
        # A local Ray cannot be preempted, and Ray Train's preemption watcher logs a
        # core_worker error line (its constructor arguments live in the object store) at every start.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        # The dashboard is where users watch a local run, and Ray Train's placement-group cleaner
        # polls the state API it serves (without it, a warning every second). The cleaner finds that
        # API through RAY_API_SERVER_ADDRESS, which every Ray process inherits from this one; without
        # it, a second Ray on the machine makes the cleaner die with "Found multiple active Ray instances".
        port = free_port()
        with environment({"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}):
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=True, dashboard_port=port, **logs)
        if not quiet:
            print(f"local Ray started; dashboard at http://127.0.0.1:{port}", flush=True)
    rearm()  # Ctrl-C and SIGTERM stay ``interruption``'s to handle
    try:
        yield not address
    finally:
        if not address:
            ray.shutdown()


CONNECT_TIMEOUT_S = 5.0


def reachable(address: str, option: str = "--address") -> str:
    """``address`` (``auto`` resolved to the cluster ``ray start`` registered) once its GCS port
    accepts a connection; a ``UsageError`` naming ``option`` otherwise. Client (``ray://``)
    addresses are left to Ray."""
    if "://" in address:
        return address
    from ray._private.services import canonicalize_bootstrap_address

    accepted = "accepted: HOST:PORT of a running cluster's head (as `ray start --head` printed), auto, or no --address for a new local Ray"
    try:
        resolved = canonicalize_bootstrap_address(address) or ""
    except (ConnectionError, ValueError) as exc:  # auto with no running cluster; not HOST:PORT
        raise UsageError(f"{option}: {address}: {' '.join(str(exc).split())}; {accepted}") from None
    host, _, port = resolved.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"{option}: {address!r} is not HOST:PORT; {accepted}")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"{option}: no Ray cluster answers at {resolved} ({reason}); {accepted}") from None
    return resolved


def use_token_if_the_cluster_asks(address: str) -> None:
    """Send this machine's Ray token when joining exactly when the cluster runs with token
    authentication, as ``RAY_AUTH_MODE=token`` would. The probe asks the GCS for its cluster id
    without a token (plain gRPC, so nothing is logged): a cluster that wants one answers
    UNAUTHENTICATED at once. Sending a token to a cluster started without one is no answer either:
    the driver's own server then refuses the cluster's calls ("Missing authorization header") and
    every actor is cancelled before it runs. ``RAY_AUTH_MODE`` set by the user wins."""
    if os.environ.get("RAY_AUTH_MODE") or "://" in address:
        return
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_TIMEOUT_S
            )
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                return  # not this probe's to report: ray.init says what is wrong with the address
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()  # Ray's own switch: the variable plus its cached config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _DropNotice(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def silence_harmless_notices() -> None:
    for logger_name, start in HARMLESS_NOTICES:
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _DropNotice) and f.start == start for f in logger.filters):
            logger.addFilter(_DropNotice(start))


def train_log_level(verbose: bool) -> str:
    """Ray Train's console log level (``RunConfig.logging_config``): its INFO lines (resource
    requests, the worker group's table, checkpoint paths) only with ``verbose``; its log files
    keep them either way."""
    return "INFO" if verbose else "WARNING"


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


def resolve_use_gpu(use_gpu: bool | None, needed: int, ranks: str) -> bool:
    """``--use-gpu`` as given; else True when the cluster has a GPU for each of ``needed`` ``ranks``.

    A cluster with some GPUs but fewer than ``needed`` trains on CPUs and says so on stderr: an
    automatic choice that cannot be honoured must not fail a run the user did not ask GPUs for."""
    if use_gpu is not None:
        return use_gpu
    gpus = cluster_totals()[1]
    if 1 <= gpus < needed:
        print(f"note: {needed} {ranks} need {needed} GPUs (one each) and the Ray cluster has {gpus:g}; training on CPUs", file=sys.stderr, flush=True)
    return gpus >= needed


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
