"""Deployment: the cluster launcher configs validate, and a job submitted with `ray job submit`
to a token-authenticated head node on 127.0.0.1 trains, or fails with its one-line error."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from raytrain_mp.cluster import free_port

from helpers import auth_mode_after_probe

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", ["cluster.yaml", "deploy/cluster-local.yaml"])
def test_cluster_configs_pass_ray_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((REPO / path).read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs before touching a cloud
    broken = copy.deepcopy(config)
    broken["max_workerz"] = 3
    with pytest.raises(Exception, match="max_workerz"):
        validate_config(prepare_config(broken))


# GPUs per instance of the AWS types named in our configs (AWS's published g5 sizes), so a declared
# `resources` entry cannot claim more than the machine has.
AWS_GPUS = {"m5.2xlarge": 0, "g5.2xlarge": 1, "g5.12xlarge": 4}


def declared_node_types(config: dict) -> dict[str, dict[str, float]]:
    """Resources of one node of each type, as the YAML declares them."""
    return {name: dict(node["resources"]) for name, node in config["available_node_types"].items()}


def submitted_jobs() -> list[tuple[str, list[str]]]:
    """(jobs/ script, its arguments) of every `ray job submit` in the README."""
    from test_readme import readme_commands

    jobs = []
    for command in readme_commands():
        if command.startswith("ray job submit"):
            words = command.split(" -- python ")[1].split()
            jobs.append((words[0], words[1:]))
    return jobs


def one_node_demand(script: str, args: list[str]) -> tuple[float, float]:
    """(CPUs, GPUs) a README job needs on a single node: the pipeline keeps its stages on one node
    (STRICT_PACK); DDP's workers are asked to fit on one box too, the README's one-box promise."""
    from raytrain_mp.cli import build_parser
    from raytrain_mp.config import build_config
    from raytrain_mp.ddp.config import DDPConfig
    from raytrain_mp.pipeline.config import PipelineConfig

    command = {"jobs/ddp_resnet.py": "ddp", "jobs/pipeline_resnet.py": "pipeline"}[script]
    given = vars(build_parser().parse_args([command, *args]))
    given = {k: v for k, v in given.items() if k not in ("handler", "command", "json")}
    if command == "pipeline":
        cfg = build_config(PipelineConfig, given)
        assert cfg.placement == "STRICT_PACK"
        return cfg.stages * cfg.cpus_per_stage, cfg.stages * bool(cfg.use_gpu)
    cfg = build_config(DDPConfig, given)
    return cfg.num_workers * cfg.cpus_per_worker, cfg.num_workers * bool(cfg.use_gpu)


def unplaceable_jobs(config: dict) -> list[str]:
    """The README's submitted training jobs that no single node type of ``config`` can hold."""
    types = declared_node_types(config)
    problems = []
    for script, args in submitted_jobs():
        if script == "jobs/tune_lr.py":
            continue  # one DDP run per trial: the ddp job's check covers its workers
        cpus, gpus = one_node_demand(script, args)
        if not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in types.values()):
            problems.append(f"{script} {' '.join(args)} needs {cpus:g} CPUs and {gpus:g} GPUs on one node")
    return problems


def test_declared_gpus_match_the_instance_types():
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    for name, node in config["available_node_types"].items():
        assert node["resources"].get("GPU", 0) == AWS_GPUS[node["node_config"]["InstanceType"]], name


def test_readme_jobs_can_be_placed_on_the_cluster_node_types():
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    assert len(submitted_jobs()) >= 2
    assert unplaceable_jobs(config) == []
    # The node type cluster.yaml had before: one A10G per node cannot hold a 2-stage GPU pipeline.
    old = copy.deepcopy(config)
    old["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"] = "g5.2xlarge"
    old["available_node_types"]["gpu_worker"]["resources"] = {"CPU": 8, "GPU": AWS_GPUS["g5.2xlarge"]}
    problems = unplaceable_jobs(old)
    assert any(
        p.startswith("jobs/pipeline_resnet.py --stages 2 --use-gpu") and "2 GPUs on one node" in p for p in problems
    ), problems


@pytest.fixture(scope="module")
def head_node(tmp_path_factory):
    """`ray start --head` on 127.0.0.1 with free ports, token auth and its own HOME and temp dir."""
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    dashboard = free_port()
    temp_dir = Path(f"/tmp/rtmp-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    # Every port free and explicit: a default one (the agent's 52365, say) may be held by another Ray here.
    ports = [
        f"--{name}={free_port()}"
        for name in (
            "port",
            "ray-client-server-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
            "node-manager-port",
            "object-manager-port",
        )
    ]
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=true",
         f"--temp-dir={temp_dir}", *ports],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.time() + 120
    while time.time() < deadline:
        probe = subprocess.run(["ray", "job", "list", "--address", address], env=env, capture_output=True, text=True)
        if probe.returncode == 0:
            break
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited: {head.stdout.read()}")
        time.sleep(2)
    else:
        raise RuntimeError("the head node's job server did not come up in 120 s")
    yield env, address, ports[0].split("=")[1]
    # `ray stop` would also stop every other Ray on this machine. Every process of this head is in
    # its process group, and `ray start --block` takes 30 s or more over a SIGTERM: kill the group.
    os.killpg(head.pid, signal.SIGKILL)
    head.wait(timeout=30)


def submit(env: dict, address: str, *job_args: str) -> tuple[str, str]:
    """Submit a job from the repository root, wait for it, and return (status, logs)."""
    job_id = f"raytrain-test-{time.time_ns()}"
    command = ["ray", "job", "submit", "--address", address, "--submission-id", job_id, "--working-dir", ".",
               "--no-wait", "--", "python", *job_args]  # fmt: skip
    for _ in range(30):  # the job agent comes up some seconds after the job server answers
        submitted = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if "No available agent" not in submitted.stderr:
            break
        time.sleep(3)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    deadline = time.time() + 600
    status = ""
    while time.time() < deadline:
        out = subprocess.run(
            ["ray", "job", "status", "--address", address, job_id], env=env, capture_output=True, text=True
        )
        found = re.search(rf"Job '{job_id}' (succeeded|failed|stopped)", out.stdout + out.stderr)
        status = found.group(1).upper() if found else ""
        if status:
            break
        time.sleep(3)
    logs = subprocess.run(["ray", "job", "logs", "--address", address, job_id], env=env, capture_output=True, text=True)
    return status, logs.stdout


@pytest.mark.slow
def test_job_submit_trains_and_checkpoints(head_node, tmp_path):
    env, address, _ = head_node
    runs = tmp_path / "runs"
    status, logs = submit(
        env, address, "jobs/ddp_resnet.py", "--no-use-gpu", "--num-workers", "2", "--epochs", "1",
        "--global-batch-size", "256", "--base-lr", "0.1", "--storage-path", str(runs), "--name", "job", "--json",
    )  # fmt: skip
    assert status == "SUCCEEDED", logs[-3000:]
    assert "epoch 1/1" in logs
    assert list(runs.glob("job/checkpoint_*/model.pt"))


@pytest.mark.slow
def test_job_submit_bad_argument_fails_with_one_line(head_node):
    env, address, _ = head_node
    status, logs = submit(env, address, "jobs/ddp_resnet.py", "--num-workers", "2", "--global-batch-size", "63")
    assert status == "FAILED"
    assert (
        "raytrain-mp: error: --global-batch-size: 63 is not divisible by --num-workers 2; accepted: a multiple of 2"
        in logs
    )


@pytest.mark.slow
def test_the_token_probe_finds_a_token_cluster(head_node):
    env, _, gcs_port = head_node
    env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    assert auth_mode_after_probe(f"127.0.0.1:{gcs_port}", env) == "token"


@pytest.mark.slow
def test_joining_a_token_cluster_uses_the_token_without_ray_auth_mode(head_node, digits_dir, tmp_path):
    """The head runs with token authentication; this machine's ~/.ray/auth_token is enough to join."""
    env, _, gcs_port = head_node
    env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run(
        ["raytrain-mp", "ddp", "--no-use-gpu", "--address", f"127.0.0.1:{gcs_port}", "--data", digits_dir,
         "--num-workers", "1", "--global-batch-size", "128", "--epochs", "1", "--storage-path", str(tmp_path),
         "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"epochs": 1' in done.stdout.splitlines()[-1]
    assert "Authentication" not in done.stderr
