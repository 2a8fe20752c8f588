"""Ctrl-C, SIGTERM and SIGKILL during ``raytrain-mp ddp`` and ``pipeline``, as a user (or the OOM
killer) sends them: the command exits 130 (143) with one line that names the last checkpoint (a
SIGKILLed one says nothing), leaves no process it started behind, and the same command run again
(with ``--quiet``: only the JSON line) continues from that checkpoint and finishes with a whole run
log.

Each command runs as a user types it (its own local Ray, a fresh HOME), on digits cut to an epoch
of 10 steps (``digits``). The ddp run is held before global step 8 (``--hold-at-step``), so it is
mid-epoch on any machine; it runs on a pseudo-terminal, where its progress line is redrawn in
place, and Ctrl-C is the terminal's (``\\x03`` written to it). The others get SIGTERM or SIGKILL
once a progress line passed step 4 (``interrupt_when``). Every process the command started carries
a marker in its environment (Ray hands the driver's environment to what it starts), which is how
the test finds any left behind; it looks after the rerun (which has a marker of its own). Ray's
agents overwrite their environment with their title, so after a SIGKILL the test also checks the
command's descendants at the kill, by process.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Callable

import psutil
import pyarrow.fs as pafs
import pytest

from raytrain_mp.checkpointing import published_checkpoints
from raytrain_mp.progress import ERASE_LINE
from raytrain_mp.readable import number
from raytrain_mp.storage import locate, name_of

from helpers import write_digits_cut
from run_log_check import checked_run_log

pytestmark = pytest.mark.slow  # two runs of a command each, with their own local Ray

STEPS = 10  # the digits cut to 640 training samples (``digits``), in batches of 64
COMMON = [
    "--epochs",
    "1",
    "--global-batch-size",
    "64",
    "--log-every",
    "2",
    "--checkpoint-every-steps",
    "2",
    "--no-use-gpu",
]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> str:
    """The built-in digits cut to 640 training samples (STEPS steps of 64: step 8 is mid-epoch) and
    160 validation samples: an interrupted epoch and its rerun at a fraction of the full set's
    steps and checkpoints, which no check here counts on."""
    return write_digits_cut(tmp_path_factory.mktemp("digits") / "cut", 640, 160)


LINE = re.compile(
    r"raytrain-mp: interrupted at epoch 1 step (\d+); the last checkpoint is (\S+); rerun the same command with --name "
    r"(\S+) to continue"
)


def command_env(tmp_path, marker: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "HOME": str(home), "RAYTRAIN_MP_TEST_MARKER": marker}


def processes_with(marker: str) -> list[str]:
    """Command lines of the live processes whose environment holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if marker.encode() not in environ.read():
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                found.append(cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:120])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def assert_nothing_left(marker: str) -> None:
    # Ray's runtime-env agent ends when it sees its raylet gone; on a busy machine (CI runs two
    # test workers on 2 cores) that took over 30 s once.
    deadline = time.monotonic() + 120
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with(marker) == []


def rerun_continues(argv: list[str], env: dict[str, str], checkpoint: str, resumed: str | None) -> dict:
    """The same command again: it resumes from ``checkpoint`` and finishes, with a run log of every
    step once; piped, its output has no carriage return or escape character. ``resumed``: the
    start of the line that says where it resumed; None: run it with ``--quiet``, which prints only
    the JSON line (the run log's event files then say where it resumed)."""
    env = {
        **env,
        "RAYTRAIN_MP_TEST_MARKER": uuid.uuid4().hex,
    }  # its own: the first run's processes are looked for after it
    done = subprocess.run(
        argv + ["--json"] + ([] if resumed else ["--quiet"]), env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "\r" not in done.stdout + done.stderr and "\x1b" not in done.stdout + done.stderr
    if resumed:
        assert (
            f"{resumed} " in done.stdout and name_of(checkpoint) in done.stdout.split(resumed, 1)[1].split("\n", 1)[0]
        )
    else:
        assert len(done.stdout.strip().splitlines()) == 1, done.stdout[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["epochs"] == 1
    checked_run_log(result["run"], steps=STEPS, epochs=1, steps_per_epoch=STEPS, log_every=2)
    run = locate(result["run"], "run")
    attempts = sorted(
        info.base_name.rsplit(".from-", 1)[1]
        for info in run.fs.get_file_info(pafs.FileSelector(run.path))
        if info.base_name.startswith("events.out.tfevents.")
    )
    assert [int(start) for start in attempts] == [
        0,
        int(name_of(checkpoint).rsplit("_", 1)[1]),
    ]  # epoch 1: step = global step
    return result


def test_ctrl_c_on_a_terminal_stops_a_ddp_run_whose_progress_line_rewrites_in_place(tmp_path, digits):
    marker = uuid.uuid4().hex
    env = command_env(tmp_path, marker)
    argv = ["raytrain-mp", "ddp", "--data", digits, "--storage-path", str(tmp_path / "runs"), *COMMON]
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the command, on the pseudo-terminal, in a session of its own
        os.execvpe(argv[0], [*argv, "--hold-at-step", f"8:{tmp_path / 'never'}"], env)
    out = b""
    deadline = time.monotonic() + 300
    while f"step 8/{STEPS}".encode() not in out:  # held before global step 8 from here on
        assert time.monotonic() < deadline, out[-2000:]
        if select.select([terminal], [], [], 1)[0]:
            out += os.read(terminal, 65536)
    while not any(
        "checkpoint_000001_step_000008" in f.read_text()
        for f in (tmp_path / "runs").glob("*/checkpoint_manager_snapshot.json")
    ):
        assert time.monotonic() < deadline, "Ray Train did not register step 8's checkpoint"
        time.sleep(0.2)
    os.write(terminal, b"\x03")  # the terminal's Ctrl-C: SIGINT to the foreground process group
    while True:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # the other end closed: the command exited
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode()
    assert os.waitstatus_to_exitcode(status) == 130, text[-3000:]
    parts = text.split("\r")  # the terminal turns each newline into \r\n
    draws = [i for i, part in enumerate(parts) if part.startswith("epoch 1/1 step ")]
    last = [parts[i].split(" loss")[0] for i in draws][-1] if draws else None
    assert len(draws) >= 3 and last == f"epoch 1/1 step 8/{STEPS}", text[-3000:]
    assert draws == list(range(draws[0], draws[-1] + 1)), "each draw replaces the one before, on the same line"
    assert all(
        re.search(r" eta \d+:\d\d \(run \d+:\d\d\)" + re.escape(ERASE_LINE), parts[i]) for i in draws[1:]
    )  # the last: then the echoed ^C
    found = LINE.search(text)
    assert found and found.group(1) == "8" and name_of(found.group(2)) == "checkpoint_000001_step_000008", text[-2000:]
    rerun_continues([*argv, "--name", found.group(3)], env, found.group(2), "resumed from")
    assert_nothing_left(marker)


def interrupt_when(
    argv: list[str], env: dict[str, str], seen: str, signum: int, before: Callable[[int], object] = lambda pid: None
) -> tuple[int, str]:
    """Run ``argv`` and, once its output holds ``seen``, call ``before(pid)`` and send it ``signum``:
    SIGINT to its process group, as a terminal's Ctrl-C; SIGTERM (SIGKILL) to the process, as
    ``kill`` (``kill -9``) does (the group would include the local Ray's own processes, which Ray
    shields from SIGINT only). (exit status, output)"""
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    out = []
    for line in process.stdout:
        out.append(line)
        if seen in line:
            before(process.pid)
            (os.killpg if signum == signal.SIGINT else os.kill)(process.pid, signum)
            break
    out.extend(process.stdout)
    return process.wait(timeout=120), "".join(out)


def left_after(processes: list[psutil.Process], marker: str, seconds: float) -> list[str]:
    """Of ``processes`` (the command's descendants when it was killed: its local Ray, the watchdog)
    and of those with ``marker``, the ones still there ``seconds`` from now. Both: Ray's agents
    re-title themselves over their environment, so the marker does not find them."""
    time.sleep(seconds)
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:  # is_running: not a reused pid
                left.append(f"{process.pid} {process.name()}")
        except psutil.Error:  # it ended while we looked
            continue
    return left + processes_with(marker)


# Ctrl-C to the process group: the terminal test above (ddp); SIGINT, SIGTERM and SIGHUP take the
# same path through ``interruption`` (tests/test_progress.py), so each command gets one of them here
# and a SIGKILL, which no handler sees.
@pytest.mark.parametrize(("command", "storage", "signum"), [
    ("pipeline", "s3", signal.SIGTERM),
    ("pipeline", "local", signal.SIGKILL),
    ("ddp", "s3", signal.SIGKILL),
])  # fmt: skip
def test_a_signal_mid_epoch_stops_the_run_and_the_same_command_continues_it(
    tmp_path, digits, request, command, storage, signum
):
    """SIGKILL (``kill -9``, the OOM killer): no line, but nothing of the command's local Ray is
    left 10 s later (``watchdog``), and the rerun continues from the last checkpoint published,
    with the losses the killed attempt showed for the steps both ran."""
    marker = uuid.uuid4().hex
    env = command_env(tmp_path, marker)
    where = request.getfixturevalue("bucket") if storage == "s3" else str(tmp_path / "runs")
    argv = [
        "raytrain-mp",
        command,
        "--data",
        digits,
        "--storage-path",
        where,
        "--name",
        f"{command}-{storage}",
        *COMMON,
    ]
    if command == "ddp":
        argv += ["--num-workers", "1"]
    descendants: list[psutil.Process] = []

    def snapshot(pid: int) -> None:  # a SIGKILL's only: the other signals go at once, as they did
        if signum == signal.SIGKILL:
            descendants.extend(psutil.Process(pid).children(recursive=True))

    status, out = interrupt_when(argv, env, f"epoch 1/1 step 4/{STEPS} ", signum, snapshot)
    if signum == signal.SIGKILL:
        assert status == -signal.SIGKILL, out[-3000:]
        assert len(descendants) > 3  # the local Ray: GCS, raylet, agents, workers; and the watchdog
        assert left_after(descendants, marker, 10) == []
        published = published_checkpoints(locate(where, "--storage-path").child(f"{command}-{storage}"))[1]
        assert published, out[-2000:]  # step 4 was shown: the checkpoint after step 2 at least
        result = rerun_continues(argv, env, published[-1].uri, None)
        # The killed attempt ran uninterrupted up to the kill: the rerun's steps logged past the
        # checkpoint it resumed from have the losses that attempt printed for them.
        shown = {int(step): loss for step, loss in re.findall(rf"epoch 1/1 step (\d+)/{STEPS} loss (\S+)", out)}
        rows = checked_run_log(result["run"], steps=STEPS, epochs=1, steps_per_epoch=STEPS, log_every=2)
        logged = {int(r["global_step"]): number(float(r["train_loss"])) for r in rows if r["kind"] == "step"}
        assert {step: logged[step] for step in shown} == shown
        return
    assert status == 128 + signum, out[-3000:]
    found = LINE.search(out)
    assert found and int(found.group(1)) >= 4 and found.group(3) == f"{command}-{storage}", out[-2000:]
    assert found.group(2).startswith(where.split("?")[0] + f"/{command}-{storage}/checkpoint_000001_step_0000")
    assert out.rstrip().endswith(found.group(0)), "the line is the last thing the command printed"
    print(out)  # pytest shows it when the rerun's checks fail: where the first run stopped
    rerun_continues(argv, env, found.group(2), None)
    assert_nothing_left(marker)
