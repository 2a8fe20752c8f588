"""Connecting to Ray: no address means a new local Ray, whatever a stale ``ray start`` left behind;
an address nobody answers at is one error line, not a hang.

Each command runs as a user types it (a subprocess), with ``RAY_TMPDIR`` a private folder, where
a ``ray start --head`` that died uncleanly would have left its ``ray_current_cluster`` file
(``stale_ray_tmpdir``): here ``PipelineTrainer``; ``raytrain-mp ddp`` in the ``--verbose`` run of
``ddp/test_ddp_output.py``, where Ray's own lines show which Ray it started or joined.

On a joined cluster a request that does not fit yet asks the autoscaler and waits, bounded, for
it: a simulated cluster (``simulated_cluster``, no autoscaler: Ray records the request and nothing
more) gets a fake 1-GPU node while a driver waits. The automatic device choice checks that torch
can use an advertised GPU: run in the fake 1-GPU session of ``test_gpu_readiness.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import closed_port


def user_env(ray_tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmpdir), RAY_USAGE_STATS_ENABLED="0")
    return env


@pytest.mark.slow
def test_pipeline_trainer_starts_a_local_ray_despite_a_stale_cluster_file(stale_ray_tmpdir):
    code = (
        "import torch\nfrom torch import nn\nfrom raytrain_mp import PipelineTrainer\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))\n"
        "with PipelineTrainer(model, 2, num_microbatches=2, use_gpu=False) as trainer:\n"
        "    print(round(trainer.train_step(torch.ones(4, 4), torch.zeros(4, dtype=torch.long)), 6) > 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=user_env(stale_ray_tmpdir), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_an_address_nobody_answers_at_is_one_line(digits_dir, tmp_path):
    """A subprocess, as a user runs it: in this session's process Ray is often connected already."""
    port = closed_port()
    for address, fragments in [
        (
            f"127.0.0.1:{port}",
            [
                "raytrain-mp: error: --address: no Ray cluster answers at ",
                f":{port} (Connection refused); accepted: HOST:PORT",
            ],
        ),
        ("head-node", ["raytrain-mp: error: --address: head-node: ", "accepted: HOST:PORT"]),
    ]:
        done = subprocess.run(
            ["raytrain-mp", "ddp", "--data", digits_dir, "--address", address, "--storage-path", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert all(fragment in lines[0] for fragment in fragments), lines[0]


def test_an_unreachable_ray_address_stops_pipeline_trainer():
    """In Python, RAY_ADDRESS (as ``ray job submit`` sets it) is joined, after the same probe."""
    port = closed_port()
    code = (
        "from torch import nn\nfrom raytrain_mp import PipelineTrainer\n"
        "PipelineTrainer(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), 2)\n"
    )
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1
    assert last.startswith("raytrain_mp.errors.UsageError: RAY_ADDRESS: no Ray cluster answers at ")
    assert f":{port} (Connection refused)" in last


def test_environment_holds_its_updates_inside_and_restores_what_was_there(monkeypatch):
    """What was set comes back, what was unset is unset again, also when the block raises."""
    from raytrain_mp.cluster import environment

    monkeypatch.setenv("RTMP_SET", "before")
    monkeypatch.delenv("RTMP_UNSET", raising=False)
    with pytest.raises(RuntimeError, match="inside"):
        with environment({"RTMP_SET": "inside", "RTMP_UNSET": "inside"}):
            assert (os.environ["RTMP_SET"], os.environ["RTMP_UNSET"]) == ("inside", "inside")
            raise RuntimeError("inside")
    assert os.environ["RTMP_SET"] == "before" and "RTMP_UNSET" not in os.environ
    with environment({}):
        assert os.environ["RTMP_SET"] == "before"


# --- the autoscaler wait and the automatic device choice: decisions, without Ray ---


def test_the_autoscale_wait_comes_from_its_variable():
    from raytrain_mp.cluster import AUTOSCALE_WAIT_S, autoscale_wait_s
    from raytrain_mp.errors import UsageError

    assert autoscale_wait_s({}) == autoscale_wait_s({"RAYTRAIN_MP_AUTOSCALE_WAIT_S": " "}) == AUTOSCALE_WAIT_S
    assert autoscale_wait_s({"RAYTRAIN_MP_AUTOSCALE_WAIT_S": "2.5"}) == 2.5
    assert autoscale_wait_s({"RAYTRAIN_MP_AUTOSCALE_WAIT_S": "0"}) == 0
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(
            UsageError, match=r"^RAYTRAIN_MP_AUTOSCALE_WAIT_S: .* accepted: a number >= 0 \(0: no wait\)$"
        ):
            autoscale_wait_s({"RAYTRAIN_MP_AUTOSCALE_WAIT_S": bad})


def test_the_waiting_line_names_what_is_missing():
    from raytrain_mp.cluster import missing, summed, waiting_line

    need = summed([{"CPU": 1.0, "GPU": 1.0}] * 4)
    assert need == {"CPU": 4.0, "GPU": 4.0}
    assert missing(need, {"CPU": 8.0, "GPU": 0.0}) == {"GPU": 4.0}
    assert waiting_line("--num-workers 4", need, {"CPU": 8.0, "GPU": 0.0}, 300) == (
        "waiting up to 300 s for the Ray autoscaler to add 4 GPUs for --num-workers 4 (the cluster has 0; "
        "RAYTRAIN_MP_AUTOSCALE_WAIT_S sets the wait)"
    )
    assert waiting_line("--num-workers 4", need, {"CPU": 2.0, "GPU": 3.0}, 1.5).startswith(
        "waiting up to 1.5 s for the Ray autoscaler to add 2 CPUs and 1 GPU for --num-workers 4 (the cluster has 2 "
        "CPUs and 3 GPUs;"
    )


def test_misfit_is_the_usage_error_line():
    from raytrain_mp.cluster import misfit

    assert misfit("--num-workers", 4, 1, 1, 8, 4) is None
    assert misfit("--num-workers", 4, 1, 1, 8, 0) == (
        "--num-workers 4 needs 4 GPUs but the Ray cluster has 0; accepted: at most 0 with --use-gpu, or --no-use-gpu"
    )
    assert (
        misfit("--num-workers", 4, 2, 0, 6, 0)
        == "--num-workers 4 needs 8 CPUs but the Ray cluster has 6; accepted: at most 3"
    )


def test_the_automatic_choice_checks_the_gpu_only_when_it_would_use_it():
    from raytrain_mp.cluster import automatic_choice

    asked = []

    def answers(result):
        def check_gpu():
            asked.append(result)
            return result

        return check_gpu

    usable, unusable, busy = (
        answers((True, "")),
        answers((False, "RuntimeError: no driver")),
        answers((None, "no GPU was free")),
    )
    assert automatic_choice(0, 2, "workers", False, unusable) == (
        False,
        None,
    )  # a local Ray without GPUs: nothing to say
    assert automatic_choice(0, 2, "workers", True, unusable) == (
        False,
        "note: the Ray cluster has no GPU up; training on CPUs (--use-gpu waits for an autoscaler to add GPU nodes)",
    )
    assert automatic_choice(1, 2, "workers", True, unusable) == (
        False,
        "note: 2 workers need 2 GPUs (one each) and the Ray cluster has 1; training on CPUs",
    )
    assert asked == []
    assert automatic_choice(2, 2, "workers", False, usable) == (True, None)
    assert automatic_choice(1, 1, "workers", False, unusable) == (
        False,
        "note: the Ray cluster advertises 1 GPU but torch cannot use it (RuntimeError: no driver); training on CPUs",
    )
    assert automatic_choice(4, 2, "stage actors", True, unusable)[1].startswith(
        "note: the Ray cluster advertises 4 GPUs but torch cannot use them ("
    )
    # no GPU free for the check in time: busy GPUs, most often; the run waits for them as any GPU run does
    assert automatic_choice(2, 2, "workers", True, busy) == (
        True,
        "note: could not check the Ray cluster's GPUs (no GPU was free); training on GPUs",
    )
    assert len(asked) == 4


# --- on Ray ---


def test_the_automatic_choice_trains_on_cpus_when_torch_cannot_use_the_advertised_gpu(ray_session, capsys):
    """Run by test_gpu_readiness.py in a session whose Ray advertises one GPU torch has no CUDA for."""
    import torch

    from raytrain_mp.cluster import joined_cluster, resolve_use_gpu

    gpus = ray_session.cluster_resources().get("GPU", 0)
    if gpus < 1:
        pytest.skip(
            "the session's Ray advertises no GPU, and the check runs only for one it advertises; "
            "RAYTRAIN_MP_TEST_RAY_GPUS=1 fakes one"
        )
    if torch.cuda.is_available():
        pytest.skip("torch can use this machine's GPUs: the fake needs an advertised GPU that torch cannot use")
    assert not joined_cluster()  # the session started its Ray
    capsys.readouterr()
    assert resolve_use_gpu(None, 1, "workers") is False
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1, notes
    it = "1 GPU but torch cannot use it" if gpus == 1 else f"{gpus:g} GPUs but torch cannot use them"
    assert notes[0].startswith(f"note: the Ray cluster advertises {it} (") and notes[0].endswith(
        "); training on CPUs"
    ), notes
    assert resolve_use_gpu(True, 1, "workers") is True  # --use-gpu is the user's: not checked


# A driver joined to the simulated cluster with --address, as a command's pre-check runs.
WAITING_DRIVER = """
import sys
from raytrain_mp.cluster import check_fits, joined_cluster, ray_connection
with ray_connection(sys.argv[1]):
    assert joined_cluster()
    check_fits("--num-workers", int(sys.argv[2]), 1, 1)
    import ray
    print("fits", ray.cluster_resources().get("GPU", 0), flush=True)
"""


@pytest.fixture(scope="module")
def head_without_gpus():
    """A simulated head with 2 CPUs and no GPU; a test may add a fake 1-GPU node to it."""
    from simulated_cluster import SimulatedCluster

    cluster = SimulatedCluster(workers=0)
    yield cluster
    cluster.shutdown()


@pytest.mark.slow  # a simulated cluster and two drivers joined to it
def test_a_request_that_does_not_fit_yet_waits_for_the_autoscaler(head_without_gpus):
    from simulated_cluster import driver_env

    env = {**driver_env(), "RAYTRAIN_MP_AUTOSCALE_WAIT_S": "120"}
    driver = subprocess.Popen(
        [sys.executable, "-c", WAITING_DRIVER, head_without_gpus.address, "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        while not seen or not seen[-1].startswith("waiting up to"):
            line = driver.stderr.readline()
            assert line, ("the driver ended before waiting", seen, driver.stdout.read())
            seen.append(line.rstrip("\n"))
        assert seen[-1].startswith(
            "waiting up to 120 s for the Ray autoscaler to add 1 GPU for --num-workers 1 (the cluster has 0;"
        ), seen
        head_without_gpus.add_worker_node(gpus=1)  # what an autoscaler would do
        out, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "fits 1.0"
    assert "waiting up to" not in err  # one line, printed once


@pytest.mark.slow  # a simulated cluster and the command joined to it
def test_a_request_the_autoscaler_does_not_meet_in_time_is_refused(head_without_gpus, digits_dir, tmp_path):
    from simulated_cluster import driver_env

    done = subprocess.run(
        ["raytrain-mp", "ddp", "--use-gpu", "--num-workers", "4", "--global-batch-size", "128", "--data", digits_dir,
         "--address", head_without_gpus.address, "--storage-path", str(tmp_path)],
        env={**driver_env(), "RAYTRAIN_MP_AUTOSCALE_WAIT_S": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 2, done.stderr[-3000:]
    # 0 GPUs, or 1 after the other test's node: never the 4 asked for
    assert re.fullmatch(
        r"waiting up to 1 s for the Ray autoscaler to add [34] GPUs for --num-workers 4 \(the cluster has [01]; .*\)",
        lines[0],
    ), lines
    assert re.fullmatch(
        r"raytrain-mp: error: --num-workers 4 needs 4 GPUs but the Ray cluster has [01]; accepted: at most [01] with "
        r"--use-gpu, or --no-use-gpu",
        lines[1],
    ), lines
