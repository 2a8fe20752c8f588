"""Simulated Ray nodes on this machine (``ray.cluster_utils.Cluster``, 2 CPUs each) that a test adds
and removes while a command runs against them with ``--address``.

The cluster lives in its own process: cluster_utils rebinds (and on shutdown resets) the calling
process's internal-KV client, which would break the test session's own Ray for later tests. Its
nodes advertise no GPUs: every simulated node would otherwise claim this machine's GPUs, and two
"nodes" would put two NCCL ranks on one GPU. Nodes share the IP, so placement is read from Ray
node ids. Its head runs no dashboard: no command run against it needs one, and each cluster's
would bind port 8265, so two clusters side by side (on the suite's two workers) collided.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CLUSTER_SCRIPT = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
workers = [cluster.add_node(num_cpus=2, num_gpus=0) for _ in range(int(sys.argv[1]))]
cluster.wait_for_nodes()
print(cluster.address, flush=True)
for line in sys.stdin:
    if line.startswith("remove"):
        cluster.remove_node(workers[int(line.split()[1])])
    elif line.startswith("add"):
        workers.append(cluster.add_node(num_cpus=2, num_gpus=int(line.split()[1]) if len(line.split()) > 1 else 0))
        cluster.wait_for_nodes()
    else:
        break
    print("done", flush=True)
cluster.shutdown()
"""


def driver_env() -> dict[str, str]:
    """This environment without RAY_ADDRESS (the commands join the cluster by ``--address``) and
    without RAY_AUTH_MODE: a local ``ray.init`` earlier in the session sets it in this process when
    ~/.ray/auth_token exists, and the cluster runs without token authentication, so the commands
    must find that out themselves (``cluster.use_token_if_the_cluster_asks``)."""
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}


START_TRIES = 2


class SimulatedCluster:
    """A head node and ``workers`` worker nodes, 2 CPUs each."""

    def __init__(self, workers: int = 1) -> None:
        # Ray gives a new node's raylet a fixed 30 s to register with the GCS (``node.py``); at a load
        # average of 17 on this machine's 2 cores (the suite's other worker in the soak) a head once
        # missed it. A second start follows the first's failure (its output stays in the test's stderr).
        for start in range(START_TRIES):
            self.process = subprocess.Popen(
                [sys.executable, "-c", CLUSTER_SCRIPT, str(workers)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=driver_env(),
                start_new_session=True,
            )
            self.address = self.process.stdout.readline().strip()
            if self.address:
                return
            self.process.wait(timeout=60)
            self._kill_group()  # what the failed start left running: its GCS, raylet and workers
            print(f"simulated cluster: start {start + 1} of {START_TRIES} failed", file=sys.stderr, flush=True)
        raise AssertionError("the cluster process exited before printing its address")

    def _ask(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "done"

    def remove_worker_node(self, index: int = 0) -> None:
        self._ask(f"remove {index}")

    def add_worker_node(self, gpus: int = 0) -> None:
        """``gpus``: a GPU resource Ray advertises, no device behind it (for checks that place nothing on it)."""
        self._ask(f"add {gpus}")

    def shutdown(self) -> None:
        try:
            self.process.communicate("stop\n", timeout=120)
        except subprocess.TimeoutExpired:
            self._kill_group()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
