"""Elastic DDP on simulated nodes (``simulated_cluster``): a group that shrinks when a node is lost
and one that grows when a node joins train the same model (fp64, 1e-9).

One cluster serves both runs in order, each a ``raytrain-mp ddp`` subprocess joined with
``--address``: every worker reserves 2 CPUs, a whole node, so the node count decides the world size.
  shrink: head + 1 node, ``--num-workers 1-2`` starts at W=2; the worker node is removed while the
    run holds after step 2, and it continues at W=1;
  grow: on the head alone (``1-2`` starts at W=1), a node added while it holds after step 2, and it
    continues at W=2.
Their world sizes are mirror images (2 then 1, 1 then 2), so a world size or a resize that changed
the model would set them apart. That a resume at a step equals the uninterrupted run, at another
world size too, is ``tests/ddp/test_ddp_train.py``'s (against a run that never stopped); here a
third, uninterrupted run on the cluster would add minutes and no other check.
The testing hook ``--hold-at-step 2:MARKER`` keeps every rank before global step 2 (just after
the step checkpoint at 2) until the test writes MARKER, so the cluster changes at a known step.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers import load_model_pt, max_abs_diff, write_digits_cut
from simulated_cluster import SimulatedCluster, driver_env

pytestmark = pytest.mark.slow  # a simulated cluster and two elastic DDP runs on it

ARGS = [
    "--no-use-gpu", "--precision", "fp64", "--epochs", "2", "--global-batch-size", "64", "--base-lr", "0.1",
    "--seed", "3", "--log-every", "0", "--cpus-per-worker", "2", "--loader-workers", "0", "--placement", "SPREAD",
    "--checkpoint-every-steps", "2", "--json",
]  # fmt: skip


class Run:
    """A ``raytrain-mp ddp`` subprocess whose output lines are collected as they come."""

    def __init__(self, address: str, storage: Path, name: str, *extra: str) -> None:
        self.run_dir = storage / name
        cmd = [
            "raytrain-mp",
            "ddp",
            "--address",
            address,
            "--storage-path",
            str(storage),
            "--name",
            name,
            *ARGS,
            *extra,
        ]
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=driver_env()
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))

    @property
    def out(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait_for(self, condition, what: str, timeout: float = 300) -> float:
        """Poll until ``condition()``; the time it held. Fails early when the run ended."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, f"the run ended before {what}:\n{self.out[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{self.out[-4000:]}"
            time.sleep(0.2)
        return time.monotonic()

    def line_time(self, fragment: str) -> float | None:
        return next((t for t, line in self.lines if fragment in line), None)

    def checkpointed(self, dir_name: str) -> bool:
        """Ray Train registered the checkpoint (its snapshot names it), not merely wrote its files."""
        snapshot = self.run_dir / "checkpoint_manager_snapshot.json"
        return snapshot.is_file() and dir_name in snapshot.read_text()

    def finish(self) -> dict:
        self.process.wait(timeout=600)
        self.reader.join(timeout=60)
        assert self.process.returncode == 0, self.out[-4000:]
        return json.loads(next(line for _, line in reversed(self.lines) if line.startswith("{")))


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory):
    storage = tmp_path_factory.mktemp("elastic")
    # 3 steps of 64 an epoch (32 a rank at W=2): step 2, where the cluster changes, is mid-epoch. The
    # comparison does not count on the size: a world size or a resize that changed the model would set
    # the runs apart after any step.
    data = ("--data", write_digits_cut(storage / "digits", 192, 64))
    cluster = SimulatedCluster(workers=1)
    try:
        go = storage / "shrink-go"
        shrink = Run(cluster.address, storage, "shrink", *data, "--num-workers", "1-2", "--max-failures", "1",
                     "--hold-at-step", f"2:{go}")  # fmt: skip
        shrink.wait_for(lambda: shrink.checkpointed("checkpoint_000001_step_000002"), "step checkpoint 2")
        cluster.remove_worker_node(0)
        lost = time.monotonic()
        again = shrink.wait_for(
            lambda: shrink.line_time("1 worker on 1 node from step 2"), "a restart at W=1", timeout=400
        )
        go.touch()
        shrink_result = shrink.finish()

        go = storage / "grow-go"
        grow = Run(cluster.address, storage, "grow", *data, "--num-workers", "1-2", "--max-failures", "1",
                   "--resize-interval", "1", "--hold-at-step", f"2:{go}")  # fmt: skip
        grow.wait_for(lambda: grow.checkpointed("checkpoint_000001_step_000002"), "step checkpoint 2")
        cluster.add_worker_node()
        joined = time.monotonic()
        grown = grow.wait_for(
            lambda: grow.line_time("2 workers on 2 nodes from step 2"), "a restart at W=2", timeout=400
        )
        go.touch()
        grow_result = grow.finish()
    finally:
        cluster.shutdown()
    print(f"node lost -> training again: {again - lost:.1f} s; node joined -> training at W=2: {grown - joined:.1f} s")
    return {
        "shrink": shrink_result,
        "shrink_out": shrink.out,
        "grow": grow_result,
        "grow_out": grow.out,
        "shrink_seconds": again - lost,
        "grow_seconds": grown - joined,
    }


def test_shrink_after_losing_a_node_continues_at_one_worker(elastic_runs):
    shrink, out = elastic_runs["shrink"], elastic_runs["shrink_out"]
    assert "2 workers on 2 nodes from step 0" in out  # SPREAD: one worker a node
    assert "checkpoint_000001_step_000002 at epoch 1 step 3" in out
    assert shrink["world_size_history"] == [[0, 2], [2, 1]]
    # a restart at the old size, chosen before Ray saw the node go, gives up after --resize-timeout (default 10 s)
    assert set(re.findall(r"startup timed out after ([\d.]+) seconds", out)) <= {"10.0"}
    assert shrink["world_size"] == 1 and shrink["num_nodes"] == 1 and shrink["epochs"] == 2


def test_grow_when_a_node_joins_continues_at_two_workers(elastic_runs):
    grow, out = elastic_runs["grow"], elastic_runs["grow_out"]
    assert "1 worker on 1 node from step 0" in out
    assert grow["world_size_history"] == [[0, 1], [2, 2]]
    assert grow["world_size"] == 2 and grow["num_nodes"] == 2 and grow["epochs"] == 2
    assert Path(grow["model"]).parent.name == "checkpoint_000002"


def test_shrink_and_grow_end_with_the_same_model(elastic_runs):
    shrink, grow = elastic_runs["shrink"], elastic_runs["grow"]
    assert max_abs_diff(load_model_pt(shrink), load_model_pt(grow)) < 1e-9
    assert shrink["train_loss"] == pytest.approx(grow["train_loss"], rel=1e-9)
    assert shrink["val_accuracy"] == grow["val_accuracy"]
