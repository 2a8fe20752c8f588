"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``, 2 CPUs each): DDP workers spread
over both, pipeline stages packed onto one, two pipeline replicas one per node, and a worker node
lost in the middle of a run.

One simulated cluster serves the module; the last test loses its worker node. The commands run as
subprocesses joined with ``--address``, as a user's would; the test session's own local Ray is
untouched (``simulated_cluster``).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from raytrain_mp.models import build_model

from helpers import auth_mode_after_probe, write_digits_cut
from simulated_cluster import SimulatedCluster, driver_env

pytestmark = pytest.mark.slow  # a simulated two-node cluster and DDP/pipeline runs on it


@pytest.fixture(scope="module")
def cluster():
    """The module's head and worker node; the last test removes the worker node."""
    cluster = SimulatedCluster(workers=1)
    yield cluster
    cluster.shutdown()


@pytest.fixture
def two_nodes(cluster) -> str:
    return cluster.address


@pytest.fixture(scope="module")
def digits_cut(tmp_path_factory) -> str:
    """Digits cut to 512 training samples (2 steps of 256) and 128 validation samples, for the
    pipeline runs, whose point is where their actors run, not the data set's size."""
    return write_digits_cut(tmp_path_factory.mktemp("digits") / "cut", 512, 128)


def test_a_token_on_this_machine_does_not_make_a_join_send_it(two_nodes, tmp_path):
    """The simulated cluster runs without token authentication: a driver that sent this machine's
    token would refuse the cluster's own calls, and every actor would be cancelled."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0" * 64)
    assert auth_mode_after_probe(two_nodes, {**driver_env(), "HOME": str(tmp_path)}) == ""


def command(address: str, *args: str) -> list[str]:
    return ["raytrain-mp", *args, "--address", address, "--log-every", "0", "--json"]


def finish(process: subprocess.Popen) -> tuple[dict, str]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, out[-3000:] + err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), out


def run(cmd: list[str]) -> tuple[dict, str]:
    return finish(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=driver_env()))


@pytest.mark.parametrize(("placement", "nodes"), [("STRICT_PACK", 1), ("SPREAD", 2)])
def test_pipeline_stages_follow_the_placement_strategy(two_nodes, digits_cut, tmp_path, placement, nodes):
    result, _ = run(command(
        two_nodes, "pipeline", "--no-use-gpu", "--data", digits_cut, "--model", "resnet18", "--stages", "2",
        "--balance", "params", "--global-batch-size", "256", "--epochs", "1", "--placement", placement,
        "--storage-path", str(tmp_path),
    ))  # fmt: skip
    assert result["num_nodes"] == nodes
    assert len({stage["node_id"] for stage in result["stages"]}) == nodes
    assert Path(result["model"]).is_file() and result["val_count"] == 128


def test_pipeline_replicas_pack_their_stages_and_spread_over_the_nodes(two_nodes, digits_cut, tmp_path):
    """--replicas 2 --stages 2 on 2 nodes of 2 CPUs: each replica's stages on one node (STRICT_PACK,
    activations never cross nodes), the replicas on different nodes (only gradients do)."""
    result, out = run(command(
        two_nodes, "pipeline", "--no-use-gpu", "--data", digits_cut, "--model", "resnet18", "--stages", "2",
        "--replicas", "2", "--microbatches", "2", "--balance", "params", "--global-batch-size", "256", "--epochs", "1",
        "--storage-path", str(tmp_path),
    ))  # fmt: skip
    nodes = [{actor["node_id"] for actor in result["actors"] if actor["replica"] == replica} for replica in (0, 1)]
    assert [len(replica_nodes) for replica_nodes in nodes] == [1, 1] and nodes[0] != nodes[1]
    assert result["num_nodes"] == 2 and result["num_replicas"] == 2
    for replica, (node,) in enumerate(nodes):
        assert f"replica {replica}: stage 0 on node {node[:8]}, stage 1 on node {node[:8]}" in out
    assert Path(result["model"]).is_file() and result["val_count"] == 128


# Last in the file: it removes the module cluster's worker node.
def test_ddp_spread_over_two_nodes_survives_losing_one(cluster, digits_dir, tmp_path):
    """SPREAD puts the 2 workers on both nodes; the worker node is removed after the first
    checkpoint. With --max-failures 1 the worker group restarts from that checkpoint on the head
    node, which still holds both workers (SPREAD is a preference, not a requirement), and finishes."""
    process = subprocess.Popen(command(
        cluster.address, "ddp", "--no-use-gpu", "--data", digits_dir, "--num-workers", "2", "--placement", "SPREAD",
        "--epochs", "2", "--max-failures", "1", "--storage-path", str(tmp_path), "--name", "lose-node",
    ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=driver_env())  # fmt: skip
    # Until Ray Train registered epoch 1's checkpoint (its snapshot names it), not merely wrote its files: epoch 2
    # needs both workers, so it cannot finish first.
    snapshot = tmp_path / "lose-node" / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 300
    while not (snapshot.is_file() and "checkpoint_000001" in snapshot.read_text()):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.2)
    cluster.remove_worker_node()
    result, out = finish(process)
    assert "2 workers on 2 nodes" in out
    assert "resumed from" in out and "at epoch 2" in out
    assert out.rindex("2 workers on 1 node") > out.index("2 workers on 2 nodes")
    assert result["epochs"] == 2 and result["num_nodes"] == 1 and result["world_size"] == 2
    assert result["val_count"] == 359 and result["val_accuracy"] > 0.8
    model = build_model("resnet18", 10, in_channels=1, small_stem=True)
    model.load_state_dict(torch.load(result["model"], weights_only=True), strict=True)
