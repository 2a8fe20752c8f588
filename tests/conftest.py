"""Shared fixtures: one real local Ray instance per test session, started only by tests that ask.

The inner loop is ``pytest -m "not slow"`` (a few minutes); tests marked ``slow`` are the
end-to-end runs of a minute or more, and CI runs everything, on two pytest-xdist workers (each
with its own session Ray; the tests start their commands' Rays, clusters and servers on free
ports, so two run side by side). Tests mirror the package's layout:
``tests/ddp``, ``tests/pipeline``, ``tests/tune``, ``tests/bench``, ``tests/data``, and the shared
layer and whole-project checks at the top.

Tests state the device they need. CPU tests pin the CPU (``--no-use-gpu``, ``use_gpu=False``,
simulated nodes with ``num_gpus=0``), so they mean the same on a GPU box; tests marked
``gpu(n)`` need n CUDA devices and skip, with the reason, where there are fewer. The session's Ray
advertises this machine's GPUs, or ``RAYTRAIN_MP_TEST_RAY_GPUS`` of them: a number there fakes a
GPU cluster on a CPU machine (``tests/test_gpu_readiness.py`` runs CPU tests that way). Its CPUs
grow with the GPUs (``helpers.session_cpus``), and tests that count either read them from
``helpers.session_gpus`` and ``helpers.session_cpus``, so they mean the same with any GPU count.

Object storage is a real S3 protocol server (moto's server mode) on 127.0.0.1, started once per
session by the tests that ask (``s3_endpoint``); its credentials are set here, before any Ray
process starts, so Ray's workers inherit them. MLflow tracking is a real ``mlflow server`` on
127.0.0.1 with a SQLite store (``mlflow_server``), started once per session by the tests that ask.
"""

from __future__ import annotations

import os

import pytest

# Their asserts show the values compared when they fail, as a test module's do.
pytest.register_assert_rewrite("helpers", "mlflow_check", "run_log_check", "simulated_cluster")

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train's controller polls its workers every 2 s, so a fit's start and end each wait up to
# one poll; measured here, 0.3 s took a 2-worker fit's end from 5.1 s to 2.3 s. Every Ray the
# tests start (the session's, the commands', the simulated clusters') inherits it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.3")
# Ray Train starts a preemption watcher actor with each fit, a process of its own; nothing here
# (a local Ray, simulated nodes on this machine) can be preempted, and the local Ray the commands
# start turns it off the same way (``cluster.ray_connection``). Measured here: 2-4 s less a 2-worker fit.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Ray's periodic bookkeeping that no test reads: the dashboard agent's stats of every process (every
# 5 s), the autoscaler monitor's loop (every 5 s; no Ray here has an autoscaler; a test that needs a
# node adds it) and the metrics every Ray process records and exports. An idle Ray burns a core's
# 20-30% with them and 9-14% without (alternating 40 s samples here); the suite runs two session
# Rays from start to end beside the commands' own, on a CPU-bound machine.
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
os.environ.setdefault("AUTOSCALER_UPDATE_INTERVAL_S", "60")
os.environ.setdefault("RAY_enable_metrics_collection", "0")
# Ray's log monitor looks for new worker log files every 0.1 s, globbing a logs folder that grows with
# every worker the session starts: 3.2% of a core for a session Ray 48 minutes into the suite (ps). At 0
# it looks every 0.5 s (LOG_NAME_UPDATE_INTERVAL_S) and reads the files it has as often as before;
# a worker's file exists from its start, long before the worker prints.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
for _name, _value in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> str:
    """One ``--compile-cache`` folder for the whole test run, pytest-xdist's workers included (the
    parent of a worker's base folder is the run's): inductor's cache is safe to share, and a graph
    one test compiled is read by the next."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "compile-cache"
    folder.mkdir(exist_ok=True)
    return str(folder)


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    """``HOST:PORT`` of a real S3 protocol server on 127.0.0.1 for this session."""
    import logging
    import socket

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # its request log would mix with the commands' stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """The tracking URI of a real ``mlflow server`` on 127.0.0.1 (SQLite store, its artifacts
    proxied into a folder of its own) for this session."""
    import signal
    import subprocess
    import time
    import urllib.request

    from helpers import closed_port

    root = tmp_path_factory.mktemp("mlflow")
    port = closed_port()
    # MLflow 3's server starts a job runner and seven Huey consumers for its GenAI jobs, which no
    # test uses. Measured here beside a running suite: serving after 63 s and 20 s of CPU, then 26% of
    # a core for a minute and 3.7% after, against 20 s, 7.6 s and 0.4% without them.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        ["mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "wb"), start_new_session=True, env=env,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    # On a loaded machine (the suite's other worker training) it once took over 2 minutes to serve:
    # its uvicorn worker process imports mlflow again after the parent did.
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert server.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()[-3000:]
        time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)


@pytest.fixture
def bucket(s3_endpoint, request) -> str:
    """A new, empty bucket; returns ``s3://BUCKET`` plus the endpoint query, the form users paste."""
    import re

    import pyarrow.fs as pafs

    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-") + f"-{os.getpid()}"
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    fs, _ = pafs.FileSystem.from_uri(f"s3://{name}{query}&allow_bucket_creation=true")
    fs.create_dir(name)
    return f"s3://{name}{query}"


def pytest_collection_modifyitems(config, items) -> None:
    """Skip ``gpu(n)`` tests where fewer than n CUDA devices exist, saying how many there are; run
    the slowest files first. The suite runs on two workers, each file whole on one (``--dist
    loadfile``, handed out in this order: ``--no-loadscope-reorder``); the longest file begun last
    would run on alone at the end. A file's weight is its measured seconds (``tests/durations.json``)
    or, for a file not measured yet, 30 s a slow test."""
    import json
    from collections import Counter
    from pathlib import Path

    import torch

    root = Path(__file__).resolve().parents[1]
    measured = json.loads((root / "tests" / "durations.json").read_text())
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))

    def weight(item) -> float:
        return measured.get(item.path.relative_to(root).as_posix(), 30 * slow[item.path])

    items.sort(key=lambda item: -weight(item))  # stable: a file's tests keep their order

    have = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        need = marker.args[0] if marker and marker.args else 1
        if marker and have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s); this machine has {have}"))


@pytest.fixture
def no_tf32():
    """Full float32 in CUDA convolutions and matmuls for the test: cuDNN uses TF32 by default,
    whose 10-bit mantissa would move a float32 comparison far past its tolerance."""
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from raytrain_mp.ray_logs import quiet_ray_train_logs

    from helpers import session_cpus, session_gpus

    if not ray.is_initialized():
        quiet_ray_train_logs()
        # "local": a new Ray of its own even where another runs on this machine (a plain init
        # would join that one through /tmp/ray/ray_current_cluster and refuse num_cpus)
        ray.init(
            address="local",
            num_cpus=session_cpus(),
            num_gpus=session_gpus(),
            include_dashboard=False,
            log_to_driver=True,
        )
    yield ray
    ray.shutdown()


@pytest.fixture
def short_tmpdir():
    """A Ray temp dir of its own, removed afterwards (short: Ray's socket paths must fit in 107 bytes)."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def stale_ray_tmpdir(short_tmpdir):
    """A Ray temp dir whose ``ray_current_cluster`` names a head that is gone, as a ``ray start
    --head`` that died uncleanly leaves it."""
    from helpers import closed_port

    (short_tmpdir / "ray").mkdir()
    (short_tmpdir / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{closed_port()}\n")
    return short_tmpdir


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    """The built-in default data set, prepared once for the session into a private cache."""
    from raytrain_mp.data import resolve_dataset

    cache = tmp_path_factory.mktemp("cache")
    os.environ["RAYTRAIN_MP_CACHE"] = str(cache)
    return resolve_dataset(None)
