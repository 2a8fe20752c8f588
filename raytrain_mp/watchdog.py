"""A local Ray never outlives the command that started it, however the command ends.

Ray's own fate-sharing covers only part of a local Ray: ``ray.init`` starts the GCS, the raylet,
the dashboard and the log monitor with ``PR_SET_PDEATHSIG`` (``kill_on_parent_death``), so the
kernel kills those with the driver. The raylet starts the rest itself, without it: the dashboard
and runtime-env agents, the workers and actors (Ray Train's controller, its workers, stage actors),
and the dashboard's module processes. After a ``kill -9`` of the driver (or an OOM kill, a closed
terminal, a CI timeout) they learn that their raylet is gone by polling, and the agents then report
it to a GCS that is gone too, which waits out Ray's RPC timeouts: they were seen over 40 s later,
with parent 1. No ``ray.init`` option or ``_system_config`` entry of Ray 2.60 shortens that, and
once the raylet is dead its children have lost their place in the process tree. So a watchdog
learns the tree while it stands:

- ``tag()`` is a fresh ``MARKER_ENV=<token>`` entry for the environment ``ray.init`` runs in. Ray
  hands the driver's environment to every process it starts, and the raylet its own to its
  workers, so they carry the token (the driver's environment is restored after ``ray.init``).
  The agents re-title themselves over their environment's memory, so the token is not enough:
- ``start(token)`` starts this module as a process of its own (its own session, so a terminal's
  Ctrl-C or hang-up reaches the command, not it), reading a pipe whose only writer is the command.
  ``started(watchdog)``, after ``ray.init``, sends it the pids ``ray.init`` started (the roots);
  every ``POLL_S`` it records the processes below them (pid and start time, so a reused pid is
  never taken for one of them).
- When the pipe ends (the command closed it, or died: the kernel closes a dead process's pipes) or
  the command is no longer its parent, it SIGKILLs the recorded processes still alive, those below
  them, and every process carrying the token, again until none is left, for at most ``SWEEP_S``
  seconds, and exits. So it lives exactly as long as the command, plus the sweep; it never touches
  a process that is neither tagged nor below the roots (the command's other children, a user's
  ``tail -f`` of Ray's logs).
- ``stop(watchdog)``, after ``ray.shutdown()``: closes the pipe and waits for the sweep, so the
  agents that a clean shutdown leaves to end on their own are gone when the command returns too.

Linux only (it reads ``/proc``); elsewhere ``start`` returns None and Ray's own clean-up is what
there is. This module imports nothing of the package, nor Ray: the watchdog process starts fast.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable

MARKER_ENV = "RAYTRAIN_MP_LOCAL_RAY"
SWEEP_S = 10.0  # a process that survives repeated SIGKILLs this long is not ours to end
POLL_S = 1.0  # how often the watchdog records the tree and checks that its parent is the command
STOP_WAIT_S = 15.0  # how long ``stop`` waits for the sweep


def tag() -> dict[str, str]:
    """The environment entry that marks a new local Ray's processes as this command's."""
    return {MARKER_ENV: uuid.uuid4().hex}


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc")


def start(token: str) -> subprocess.Popen | None:
    """The watchdog of the processes tagged ``token``, a child of this process; None where unsupported."""
    if not supported():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "raytrain_mp.watchdog", token, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=watchdog_env(),
    )


def watchdog_env() -> dict[str, str]:
    """This environment, with this copy of the package first on the path (the one that is running,
    whichever is installed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    return {**{k: v for k, v in os.environ.items() if k != MARKER_ENV}, "PYTHONPATH": path}


def started(watchdog: subprocess.Popen | None, pids: Iterable[int]) -> None:
    """Tell the watchdog the processes ``ray.init`` started: it watches them and all below them."""
    if watchdog is None:
        return
    try:
        watchdog.stdin.write(("roots " + " ".join(map(str, pids)) + "\n").encode())
        watchdog.stdin.flush()
    except OSError:  # it is gone: nothing to tell
        pass


def stop(watchdog: subprocess.Popen | None) -> None:
    """End the watch: the watchdog sweeps what is left of the local Ray and exits."""
    if watchdog is None:
        return
    try:
        watchdog.stdin.close()
        watchdog.wait(timeout=STOP_WAIT_S)
    except (OSError, subprocess.TimeoutExpired):  # its sweep is bounded: it ends on its own
        pass


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every live process."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:  # ended meanwhile
            continue
        if fields[0] != b"Z":
            found[int(name)] = (int(fields[1]), int(fields[19]))
    return found


def below(roots: Iterable[int], table: dict[int, tuple[int, int]]) -> set[int]:
    """``roots`` (those alive) and every live process below them."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [pid for pid in roots if pid in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def tagged(token: str) -> set[int]:
    """The live processes whose environment holds ``MARKER_ENV=token``."""
    needle = f"{MARKER_ENV}={token}".encode()
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    found.add(int(name))
        except OSError:  # ended meanwhile, or another user's
            continue
    return found


class Watch:
    """What the watchdog knows: the token, the roots and every (pid, start time) seen below them."""

    def __init__(self, token: str, spare: set[int]) -> None:
        self.token, self.spare = token, spare
        self.roots: list[int] = []
        self.seen: dict[int, int] = {}

    def record(self) -> None:
        table = processes()
        self.seen.update({pid: table[pid][1] for pid in below(self.roots, table)})

    def ours(self) -> set[int]:
        """The live processes of the local Ray: recorded (same start time), tagged, and those below them."""
        table = processes()
        recorded = {pid for pid, started_at in self.seen.items() if table.get(pid, (0, None))[1] == started_at}
        return below(recorded | self.tagged_now(), table) - self.spare

    def tagged_now(self) -> set[int]:
        return tagged(self.token)

    def sweep(self, limit_s: float = SWEEP_S) -> int:
        """SIGKILL the local Ray's processes until none is left, for at most ``limit_s``; the kills sent."""
        kills = 0
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            found = self.ours()
            if not found:
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                except OSError:
                    pass
            time.sleep(0.1)
        return kills


def watch(token: str, command: int) -> None:
    """Record the tree below the roots the command sends until the command ends (this process's
    parent, holding the other end of stdin), then sweep it."""
    for each in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(each, signal.SIG_IGN)  # only the command's end ends the watch
    state = Watch(token, {os.getpid(), command})
    pending = b""
    open_ = True
    while open_:
        # What the command wrote before it died is still in the pipe: read it before leaving.
        alive = os.getppid() == command
        readable, _, _ = select.select([sys.stdin.buffer], [], [], POLL_S if alive else 0)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 4096)
            open_ = bool(chunk)  # end of the pipe: the command closed it or died
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.startswith(b"roots "):
                    state.roots = [int(pid) for pid in line.split()[1:]]
        state.record()
        open_ = open_ and (alive or bool(readable))
    state.sweep()


if __name__ == "__main__":
    watch(sys.argv[1], int(sys.argv[2]))
