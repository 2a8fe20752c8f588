"""Connecting to Ray: no address means a new local Ray, whatever a stale ``ray start`` left behind;
an address nobody answers at is one error line, not a hang.

Each command runs as a user types it (a subprocess), with ``RAY_TMPDIR`` a private folder, where
a ``ray start --head`` that died uncleanly would have left its ``ray_current_cluster`` file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest



@pytest.fixture
def stale_ray_tmpdir():
    """A Ray temp dir whose ``ray_current_cluster`` names a head that is gone (short: socket paths)."""
    folder = Path(f"/tmp/rts-{os.getpid()}")
    (folder / "ray").mkdir(parents=True, exist_ok=True)
    (folder / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{closed_port()}\n")
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


def user_env(ray_tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmpdir), RAY_USAGE_STATS_ENABLED="0")
    return env


@pytest.mark.slow
def test_no_address_starts_a_local_ray_despite_a_stale_cluster_file(stale_ray_tmpdir, digits_dir, tmp_path):
    done = subprocess.run(
        ["raytrain-mp", "ddp", "--no-use-gpu", "--data", digits_dir, "--num-workers", "1", "--global-batch-size", "128",
         "--epochs", "1", "--storage-path", str(tmp_path / "runs"), "--json"],
        env=user_env(stale_ray_tmpdir), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "local Ray started" in done.stdout and "Connecting to existing Ray cluster" not in done.stderr
    assert '"epochs": 1' in done.stdout.splitlines()[-1]


@pytest.mark.slow
def test_pipeline_trainer_starts_a_local_ray_despite_a_stale_cluster_file(stale_ray_tmpdir):
    code = (
        "import torch\nfrom torch import nn\nfrom raytrain_mp import PipelineTrainer\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))\n"
        "with PipelineTrainer(model, 2, num_microbatches=2, use_gpu=False) as trainer:\n"
        "    print(round(trainer.train_step(torch.ones(4, 4), torch.zeros(4, dtype=torch.long)), 6) > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=user_env(stale_ray_tmpdir), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_an_address_nobody_answers_at_is_one_line(digits_dir, tmp_path):
    """A subprocess, as a user runs it: in this session's process Ray is often connected already."""
    port = closed_port()
    for address, fragments in [
        (f"127.0.0.1:{port}", ["raytrain-mp: error: --address: no Ray cluster answers at ", f":{port} (Connection refused); accepted: HOST:PORT"]),
        ("head-node", ["raytrain-mp: error: --address: head-node: ", "accepted: HOST:PORT"]),
    ]:
        done = subprocess.run(
            ["raytrain-mp", "ddp", "--data", digits_dir, "--address", address, "--storage-path", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
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
