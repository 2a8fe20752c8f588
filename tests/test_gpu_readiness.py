"""On a GPU box the suite means what it means here: CPU tests pin the CPU, GPU tests skip or run.

The check fakes "a cluster with 1 GPU" on this CPU machine: a pytest run in a child process whose
session Ray advertises one GPU (``RAYTRAIN_MP_TEST_RAY_GPUS=1``, see ``conftest.py``) while torch
sees no CUDA device. Nothing there may touch CUDA: CPU tests must pick the CPU although the cluster
offers a GPU (an automatic choice would put a 1-GPU rank on CUDA and fail), the messages about too
few GPUs must count the cluster's one, and GPU tests must skip with their reason. A second child
fakes 4 GPUs for the tests whose counts come from the session's GPUs and CPUs, as on a multi-GPU
box, where a fixed count would meet another check (CPUs, batch division) before the GPU one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import session_cpus

REPO = Path(__file__).resolve().parents[1]

GPU_TEST = "tests/ddp/test_sync_batchnorm.py::test_cuda_model_gets_native_sync_batchnorm"  # skips on a fake GPU cluster
# The tests whose counts come from the session's GPUs and CPUs (helpers.session_gpus, session_cpus),
# each refused before anything starts (seconds), and the GPU test.
COUNTED_FROM_THE_SESSION = [
    "tests/test_gpu_readiness.py::test_the_session_ray_advertises_the_gpus_it_is_given",
    "tests/test_cluster.py::test_the_automatic_choice_trains_on_cpus_when_torch_cannot_use_the_advertised_gpu",
    "tests/ddp/test_ddp_config.py::test_cluster_too_small",
    "tests/pipeline/test_pipeline_cli.py::test_more_stages_than_gpus",
    "tests/pipeline/test_pipeline_cli.py::test_more_replicas_than_the_cluster_holds",
    "tests/pipeline/test_pipeline_trainer.py::test_more_stages_than_gpus_fails_before_any_actor",
    "tests/pipeline/test_pipeline_trainer.py::test_bad_input_fails_before_any_actor",
    "tests/pipeline/test_pipeline_replicas.py::test_bad_replicas_fail_before_any_actor",
    "tests/tune/test_tune_sweep.py::test_trials_larger_than_the_cluster",
    GPU_TEST,
]
# Those, and CPU tests that each resolve a device against the cluster. (Not the benches' smokes:
# a bench takes its device from --use-gpu and this machine's CUDA devices, never from the cluster,
# bench_use_gpu; the test that it refuses GPUs that are not there runs here.)
ON_A_FAKE_GPU_CLUSTER = [
    *COUNTED_FROM_THE_SESSION,
    "tests/pipeline/test_pipeline_trainer.py::test_a_killed_stage_is_named",
    "tests/bench/test_bench.py::test_bench_refuses_gpus_that_are_not_there",
]


def test_the_session_ray_advertises_the_gpus_it_is_given(ray_session) -> None:
    import torch

    want = int(os.environ.get("RAYTRAIN_MP_TEST_RAY_GPUS") or torch.cuda.device_count())
    resources = ray_session.cluster_resources()
    assert (resources.get("GPU", 0), resources["CPU"]) == (want, session_cpus())


@pytest.mark.slow  # a child pytest session with its own Ray; with 1 GPU also a pipeline
@pytest.mark.skipif(bool(os.environ.get("RAYTRAIN_MP_TEST_RAY_GPUS")), reason="already inside the fake-GPU session")
@pytest.mark.parametrize(
    ("gpus", "tests"), [(1, ON_A_FAKE_GPU_CLUSTER), (4, COUNTED_FROM_THE_SESSION)], ids=["1-gpu", "4-gpus"]
)
def test_cpu_tests_pick_the_cpu_on_a_cluster_that_advertises_a_gpu(tmp_path, gpus: int, tests: list[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA GPUs: the fake must be a cluster whose GPU torch cannot use")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAYTRAIN_MP_TEST_RAY_GPUS"] = str(gpus)
    # one pytest worker (-n 0): a handful of tests need one Ray and one collection, not the suite's two
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "t"), *tests],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    # every CPU test passed (parametrized ones count each case) and the GPU test skipped, saying why
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= len(tests) - 1 and not re.search(r"\d+ failed", out), out[-3000:]
    assert re.search(
        r"SKIPPED \[1\] tests/ddp/test_sync_batchnorm\.py:\d+: needs 1 CUDA GPU\(s\); this machine has 0", out
    ), out[-3000:]
    assert "1 skipped" in out


GPU_CHECK_BUDGET_S = 480  # scripts/gpu_check.sh: 8 minutes on one H200 with 16 CPU cores


def test_gpu_check_steps_fit_its_budget() -> None:
    """The time limits of scripts/gpu_check.sh's steps add up to its budget at most: a step that
    grows, or a new one, must take its time from another."""
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    calls = re.findall(r"^\s*step \S+.*$", script, re.MULTILINE)
    limits = dict(re.findall(r"^\s*step (\w+) (\d+) ", script, re.MULTILINE))
    assert calls and len(limits) == len(calls), calls  # every step call read, its limit a number of seconds
    assert sum(int(limit) for limit in limits.values()) <= GPU_CHECK_BUDGET_S, limits


@pytest.mark.slow  # a child pytest that collects the whole suite
def test_gpu_check_reports_what_it_ran_and_what_it_skipped(tmp_path) -> None:
    import json

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA GPUs: the GPU check runs for real there (minutes)")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert (report["cuda_gpus"], report["passed"]) == (0, True)
    steps = {step["name"]: step for step in report["steps"]}
    assert (steps["tests"]["status"], steps["tests"]["returncode"]) == ("passed", 0)
    assert re.search(
        r"\d+ skipped", (tmp_path / "out" / "tests.log").read_text()
    )  # the gpu tests, each with its reason
    for name in ("ray_head", "bench_ddp"):
        assert (steps[name]["status"], steps[name]["reason"]) == ("skipped", "no CUDA GPU"), name
    assert steps["bench_pipeline"]["reason"] == "2 stages need 2 GPUs (one each); this machine has 0"
    assert steps["data_path"]["status"] == "passed"  # scripts/gpu_check_data.py skips by itself, exit 0
    assert json.loads(done.stdout.strip().splitlines()[-1])["passed"] is True
