"""Connecting to Ray and checking that a job's resource request fits, before anything is scheduled.

Invariants: an explicit ``--address`` (or ``RAY_ADDRESS``, as ``ray job submit`` sets it) joins that
cluster, after a probe that answers within ``CONNECT_TIMEOUT_S`` (an unreachable address is one
``UsageError`` line, never Ray's minutes of retries); otherwise a new local Ray is started
(``address="local"``, whatever a stale ``ray start`` left in Ray's temp dir) with this machine's
CPUs and GPUs and shut down by the caller that started it; its processes never outlive this one,
however it ends (SIGKILL, an OOM kill: ``watchdog``). A request larger than the cluster is a
``UsageError`` naming the option, raised before any actor or worker starts (a Ray Train or Tune job
would otherwise wait forever). On a joined cluster (``joined_cluster``) that request first asks the
autoscaler for its bundles and waits up to ``RAYTRAIN_MP_AUTOSCALE_WAIT_S`` (``AUTOSCALE_WAIT_S``)
for them, saying so in one stderr line, and clears the request when the wait ends; a Ray this
process started never waits (it cannot grow).

Without ``--use-gpu``/``--no-use-gpu`` the device is chosen once: GPUs when the cluster advertises
one per rank and one Ray task holding a GPU can put a tensor on it (``check_cluster_gpu``, bounded
by ``GPU_CHECK_TIMEOUT_S``); otherwise CPUs, with one ``note:`` line on stderr saying why. The
automatic choice never asks an autoscaler for GPUs; an explicit ``--use-gpu`` is never checked, only
waited for.

Quiet by default: the terminal shows the commands' own lines and Ray's warnings and errors; Ray's
informational lines stay in Ray's log files, and ``verbose`` brings them back (``ray_logs``).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import ray

import raytrain_mp.watchdog as watchdog
from raytrain_mp.errors import UsageError
from raytrain_mp.interruption import rearm
from raytrain_mp.ray_logs import quiet_ray_train_logs, silence_harmless_notices


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
    logs = dict(
        log_to_driver=True, logging_level=level, logging_config=ray.LoggingConfig(encoding="TEXT", log_level=level)
    )
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
        # Every process of this Ray carries the tag; the watchdog ends them when this process
        # ends, however it ends (``watchdog``: Ray's own fate-sharing misses the raylet's children).
        marker = watchdog.tag()
        guard = watchdog.start(marker[watchdog.MARKER_ENV])
        try:
            with environment({"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}", **marker}):
                ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=True, dashboard_port=port, **logs)
            watchdog.started(guard, [process.pid for _, process in ray._private.worker._global_node.live_processes()])
        except BaseException:
            watchdog.stop(guard)
            raise
        if not quiet:
            print(f"local Ray started; dashboard at http://127.0.0.1:{port}", flush=True)
    rearm()  # Ctrl-C and SIGTERM stay ``interruption``'s to handle
    try:
        yield not address
    finally:
        if not address:
            try:
                ray.shutdown()
            finally:
                watchdog.stop(guard)


CONNECT_TIMEOUT_S = 5.0


def reachable(address: str, option: str = "--address") -> str:
    """``address`` (``auto`` resolved to the cluster ``ray start`` registered) once its GCS port
    accepts a connection; a ``UsageError`` naming ``option`` otherwise. Client (``ray://``)
    addresses are left to Ray."""
    if "://" in address:
        return address
    from ray._private.services import canonicalize_bootstrap_address

    accepted = (
        "accepted: HOST:PORT of a running cluster's head (as `ray start --head` printed), auto, "
        "or no --address for a new local Ray"
    )
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


def cluster_totals() -> tuple[float, float]:
    """(CPUs, GPUs) of the whole cluster."""
    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


def joined_cluster() -> bool:
    """True when this process joined a Ray it did not start (``--address``, ``RAY_ADDRESS``, a
    ``ray job submit`` driver, a caller's ``ray.init(address=...)``): only such a cluster can grow.
    False for a Ray this process started (``ray_connection`` without an address, the test session's,
    a caller's plain ``ray.init()``), whose resources are this machine's, and for a Ray Client
    (``ray://``) driver, which has no GCS connection of its own to ask the autoscaler through. Ray's
    own record of it, so the pipeline trainer's and a caller's ``ray.init`` are covered too."""
    node = ray._private.worker._global_node
    return node is not None and not node.is_head()


# How long a request that does not fit yet waits for the autoscaler. A cluster-launcher GPU node
# (cluster.yaml: a g5.12xlarge from the Deep Learning AMI) is several minutes from the request to its
# GPUs in ray.cluster_resources(): the instance boots, runs setup_commands (a pip install of this
# package) and `ray start`. Ten minutes covers that with room; a request the autoscaler can never
# meet (max_workers reached, no cloud quota, a cluster without an autoscaler) still ends in one
# bounded wait with the usual error. 0 turns the wait off.
AUTOSCALE_WAIT_S = 600.0
AUTOSCALE_WAIT_ENV = "RAYTRAIN_MP_AUTOSCALE_WAIT_S"
AUTOSCALE_POLL_S = 1.0


def autoscale_wait_s(environ: Mapping[str, str] = os.environ) -> float:
    """``RAYTRAIN_MP_AUTOSCALE_WAIT_S`` in seconds, or ``AUTOSCALE_WAIT_S`` when it is unset or empty."""
    text = environ.get(AUTOSCALE_WAIT_ENV, "").strip()
    if not text:
        return AUTOSCALE_WAIT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise UsageError(
            f"{AUTOSCALE_WAIT_ENV}: {text!r} is not a number of seconds; accepted: a number >= 0 (0: no wait)"
        )
    return seconds


def summed(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The resources of all ``bundles`` together."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            total[resource] = total.get(resource, 0.0) + amount
    return total


def missing(need: Mapping[str, float], have: Mapping[str, float]) -> dict[str, float]:
    """What ``have`` lacks of ``need``, per resource (only those it lacks)."""
    return {
        resource: amount - have.get(resource, 0.0)
        for resource, amount in need.items()
        if amount > have.get(resource, 0.0)
    }


def waiting_line(what: str, need: Mapping[str, float], have: Mapping[str, float], wait_s: float) -> str:
    """The one stderr line of an autoscaler wait, e.g. ``waiting up to 600 s for the Ray autoscaler
    to add 4 GPUs for --num-workers 4 (the cluster has 0)``."""
    short = missing(need, have)
    add = " and ".join(f"{amount:g} {resource}{'s' * (amount != 1)}" for resource, amount in short.items())
    if len(short) == 1:
        has = f"{have.get(next(iter(short)), 0.0):g}"
    else:
        has = " and ".join(f"{have.get(resource, 0.0):g} {resource}s" for resource in short)
    return (
        f"waiting up to {wait_s:g} s for the Ray autoscaler to add {add} for {what} "
        f"(the cluster has {has}; {AUTOSCALE_WAIT_ENV} sets the wait)"
    )


def wait_for_autoscaler(what: str, bundles: Sequence[Mapping[str, float]]) -> bool:
    """When this process joined a cluster (``joined_cluster``) whose CPUs and GPUs cannot hold
    ``bundles`` yet, ask the autoscaler for them and wait, up to ``autoscale_wait_s()``, until they
    can, saying so in one line on stderr; ``what`` names the request (``--num-workers 4``). Returns
    whether it waited; the caller's own check then passes or refuses as before.

    ``request_resources`` only records the request (Ray 2.60: a GCS call for autoscaler v2, an
    internal-KV entry for v1), so a cluster without an autoscaler takes it and nothing happens:
    the wait runs out. The request is cleared when the wait ends, met or not: Ray keeps it until it
    is overridden, and the autoscaler neither lets nodes that serve it go idle nor stops launching
    for it (v1's ``_get_nodes_needed_for_request_resources``), so a standing request would keep GPU
    nodes up, and paid for, after the job, or launch them for a job that gave up. The job's own
    placement groups hold the nodes from seconds after the wait; ``idle_timeout_minutes`` covers the
    gap. The request is the cluster's one: clearing it also clears another driver's."""
    bundles = [{k: v for k, v in bundle.items() if v} for bundle in bundles]  # a zero amount asks for nothing
    need = summed(bundles)
    have = dict(zip(("CPU", "GPU"), cluster_totals()))
    if not missing(need, have) or not joined_cluster():
        return False
    wait_s = autoscale_wait_s()
    if wait_s <= 0:
        return False
    from ray.autoscaler.sdk import request_resources

    print(waiting_line(what, need, have, wait_s), file=sys.stderr, flush=True)
    request_resources(bundles=bundles)
    try:
        deadline = time.monotonic() + wait_s
        while missing(need, dict(zip(("CPU", "GPU"), cluster_totals()))) and time.monotonic() < deadline:
            time.sleep(max(0.0, min(AUTOSCALE_POLL_S, deadline - time.monotonic())))
    finally:
        request_resources(bundles=[])  # Ray's reset: an empty request replaces the standing one
    return True


# How long the automatic device choice waits for its one CUDA check. It starts a worker process
# that imports torch and makes a CUDA context: seconds on an idle node. A check that has not
# answered by then is queued behind jobs that hold the GPUs (or on a slow node), not failing.
GPU_CHECK_TIMEOUT_S = 30.0


def cuda_check() -> str:
    """Run as a Ray task holding one GPU: '' when torch can put a tensor on it, else why not (one line)."""
    try:
        import torch

        torch.zeros(1, device="cuda")
    except Exception as exc:  # noqa: BLE001 (any failure means: not usable here)
        return " ".join(f"{type(exc).__name__}: {exc}".split())
    return ""


_gpu_checks: dict[str, tuple[bool | None, str]] = {}


def check_cluster_gpu() -> tuple[bool | None, str]:
    """Whether torch can use a GPU the cluster advertises: (True, ''), (False, why), or (None, why)
    when the check found no free GPU within ``GPU_CHECK_TIMEOUT_S``. One Ray task with ``num_gpus=1``
    (and no CPU, so busy CPUs do not hold it up), once per Ray job of this process. It checks the
    GPU Ray hands it, on one node: the case it catches is a cluster that advertises GPUs its torch
    cannot use at all (a CPU-only torch, a broken driver, ``num_gpus`` given by hand)."""
    job = ray.get_runtime_context().get_job_id()
    if job not in _gpu_checks:
        ref = ray.remote(num_gpus=1, num_cpus=0, max_retries=0)(cuda_check).remote()
        try:
            why = ray.get(ref, timeout=GPU_CHECK_TIMEOUT_S)
            _gpu_checks[job] = (not why, why)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)  # a queued check must not take a GPU later
            _gpu_checks[job] = (None, f"no GPU was free for the check within {GPU_CHECK_TIMEOUT_S:g} s")
        except ray.exceptions.RayError as exc:  # its worker died: a crash in CUDA's start, most often
            _gpu_checks[job] = (False, " ".join(f"{type(exc).__name__}: {exc}".split())[:300])
    return _gpu_checks[job]


def automatic_choice(
    gpus: float, needed: int, ranks: str, joined: bool, check_gpu: Callable[[], tuple[bool | None, str]]
) -> tuple[bool, str | None]:
    """(train on GPUs?, a ``note:`` line for stderr or None) when ``--use-gpu`` is not given, for
    ``needed`` ``ranks`` on a cluster that advertises ``gpus`` now. ``check_gpu`` is asked only
    when the GPUs would be used.

    GPUs when the cluster has one for each rank and torch can use them. A check that got no GPU in
    time counts as usable: GPUs that jobs are busy on are the usual reason, and the run then waits
    for them as any GPU run does, where the CPU would silently give up GPUs the cluster does have.
    The choice never asks an autoscaler for GPU nodes (a run that did not ask for GPUs must not
    start paid GPU instances); on a joined cluster with none up it says so, naming ``--use-gpu``,
    which does ask (``wait_for_autoscaler``)."""
    gpu_word = "GPU" if gpus == 1 else "GPUs"
    if gpus == 0:
        if joined:
            return (
                False,
                "note: the Ray cluster has no GPU up; training on CPUs (--use-gpu waits for an autoscaler to add GPU "
                "nodes)",
            )
        return False, None
    if gpus < needed:
        return (
            False,
            f"note: {needed} {ranks} need {needed} GPUs (one each) and the Ray cluster has {gpus:g}; training on CPUs",
        )
    usable, why = check_gpu()
    if usable is False:
        return (
            False,
            f"note: the Ray cluster advertises {gpus:g} {gpu_word} but torch cannot use "
            f"{'it' if gpus == 1 else 'them'} ({why}); training on CPUs",
        )
    if usable is None:
        return True, f"note: could not check the Ray cluster's {gpu_word} ({why}); training on GPUs"
    return True, None


def resolve_use_gpu(use_gpu: bool | None, needed: int, ranks: str) -> bool:
    """``--use-gpu`` as given (the user's choice: not checked here; ``check_fits`` waits for it);
    else ``automatic_choice`` on the connected cluster, its note on stderr.

    A cluster with some GPUs but fewer than ``needed``, or GPUs torch cannot use, trains on CPUs and
    says so: an automatic choice that cannot be honoured must not fail a run the user did not ask
    GPUs for."""
    if use_gpu is not None:
        return use_gpu
    chosen, note = automatic_choice(cluster_totals()[1], needed, ranks, joined_cluster(), check_cluster_gpu)
    if note:
        print(note, file=sys.stderr, flush=True)
    return chosen


def misfit(count_option: str, count: int, cpus_each: float, gpus_each: float, cpus: float, gpus: float) -> str | None:
    """Why ``count`` units of (cpus_each, gpus_each) do not fit a cluster of ``cpus`` and ``gpus``
    (the UsageError's line), or None when they fit."""
    if count * cpus_each > cpus:
        return (
            f"{count_option} {count} needs {count * cpus_each:g} CPUs but the Ray cluster has {cpus:g}; "
            f"accepted: at most {int(cpus // cpus_each)}"
        )
    if count * gpus_each > gpus:
        return (
            f"{count_option} {count} needs {count * gpus_each:g} GPUs but the Ray cluster has {gpus:g}; "
            f"accepted: at most {int(gpus // gpus_each)} with --use-gpu, or --no-use-gpu"
        )
    return None


def check_fits(count_option: str, count: int, cpus_each: float, gpus_each: float) -> None:
    """Raise a UsageError when ``count`` units of (cpus_each, gpus_each) exceed the cluster, after
    ``wait_for_autoscaler`` on a joined one."""
    wait_for_autoscaler(f"{count_option} {count}", [{"CPU": cpus_each, "GPU": gpus_each}] * count)
    reason = misfit(count_option, count, cpus_each, gpus_each, *cluster_totals())
    if reason:
        raise UsageError(reason)
