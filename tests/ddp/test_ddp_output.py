"""What a newcomer sees: the main job prints its own lines only, and ``--verbose`` brings Ray's back.

The command runs as a user types it (a subprocess, a fresh HOME, no RAY_ADDRESS), so it starts its
own local Ray, also while this test session's Ray is up (a second Ray on the machine used to make
Ray Train's placement-group cleaner die with a traceback), and also where a ``ray start`` that died
uncleanly left a cluster file naming its gone head (``stale_ray_tmpdir``): no address means a new
local Ray.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

# Every line the tool itself prints on a successful run.
OWN_LINES = [
    r"local Ray started; dashboard at http://127\.0\.0\.1:\d+",
    r"\d+ workers? on \d+ nodes? from step \d+",
    r"epoch \d+/\d+ train_loss \S+ val_loss \S+ val_accuracy \S+ samples/s \S+ lr \S+",
    r"epoch \d+/\d+ step \d+/\d+ loss \S+ samples/s \S+ eta (\?|\d+:\d\d(:\d\d)? \(run \d+:\d\d(:\d\d)?\))",
    r"ddp training finished",
    r"note: \d+ workers need \d+ GPUs \(one each\) and the Ray cluster has \d+; training on CPUs",  # a 1-GPU machine
    r"  \w+: .+",
]


def run_main_job(
    tmp_path, *extra: str, ray_tmpdir: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTRAIN_MP_CACHE")}, **(env or {})}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", **({"RAY_TMPDIR": ray_tmpdir} if ray_tmpdir else {}))
    done = subprocess.run(
        ["raytrain-mp", "ddp", "--epochs", "1", *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done


@pytest.mark.slow
def test_main_job_prints_only_its_own_lines(tmp_path, short_tmpdir):
    """Also where Ray's autoscaling coordinator answers late (a loaded machine): Ray Train's notice
    of it, with its traceback, goes to Ray Train's system log, not to the terminal."""
    late = {"RAY_TRAIN_CALLBACKS": "late_coordinator.LateCoordinator", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = run_main_job(tmp_path, "--log-every", "10", ray_tmpdir=str(short_tmpdir), env=late)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    foreign = [line for line in lines if not any(re.fullmatch(pattern, line) for pattern in OWN_LINES)]
    assert foreign == [], foreign
    logs = short_tmpdir.glob("ray/session_*/logs/train/ray-train-sys-controller-*")
    system_log = "".join(path.read_text() for path in logs)
    assert "Failed to send resource request" in system_log and "Failed to cancel resource request" in system_log
    assert any(line.startswith("epoch 1/1 train_loss ") for line in lines) and "ddp training finished" in lines
    assert [line.split(" loss")[0] for line in lines if " eta " in line] == [
        "epoch 1/1 step 10/22",
        "epoch 1/1 step 20/22",
    ]


@pytest.mark.slow
def test_verbose_brings_back_rays_lines_and_no_address_starts_a_local_ray_despite_a_stale_cluster_file(
    tmp_path, stale_ray_tmpdir
):
    """On a 64/16 cut of digits (1 step, not 22): what Ray prints at start-up does not depend on the
    data, and the newcomer's own command, on the default data, is the test above's. Ray's lines
    also say which Ray the command used: a new local one, not the stale file's gone head."""
    from helpers import write_digits_cut

    data = write_digits_cut(tmp_path / "digits", 64, 16)
    done = run_main_job(tmp_path, "--verbose", "--data", data, ray_tmpdir=str(stale_ray_tmpdir))
    out = done.stdout + done.stderr
    assert "Started training worker group of size 2" in out  # Ray Train's controller, at INFO
    assert "Started a local Ray instance" in out  # Ray's driver, at INFO
    assert "local Ray started" in done.stdout and "Connecting to existing Ray cluster" not in out
    assert re.search(r"^.*epoch 1/1 train_loss", out, re.M)
