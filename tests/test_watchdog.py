"""The watchdog of a local Ray, without Ray: a stand-in command starts it, a tagged process and an
untagged root with a child (as ``ray.init`` starts the raylet, whose agents lose the tag), each in a
session of its own (nothing ends them with the command); when the command dies by SIGKILL, or
stops the watch, those and the watchdog are gone, and the command's other child is left alone.
The end to end case (a SIGKILLed ``raytrain-mp ddp`` and ``pipeline``) is in
``tests/test_interrupt.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from raytrain_mp import watchdog

pytestmark = pytest.mark.skipif(not watchdog.supported(), reason="the watchdog reads /proc (Linux)")

COMMAND = """
import json, os, subprocess, sys, time
from raytrain_mp import watchdog
marker = watchdog.tag()
guard = watchdog.start(marker[watchdog.MARKER_ENV])
tagged = subprocess.Popen(["sleep", "300"], env={**os.environ, **marker}, start_new_session=True)
root = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True)
child = int(root.stdout.readline())
watchdog.started(guard, [root.pid])
other = subprocess.Popen(["sleep", "300"], start_new_session=True)
pids = {"watchdog": guard.pid, "tagged": tagged.pid, "root": root.pid, "child": child, "other": other.pid}
print(json.dumps(pids), flush=True)
if sys.argv[1] == "stop":
    watchdog.stop(guard)
    print("stopped", flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(map(alive, pids))


@pytest.mark.parametrize("end", ["sigkill", "stop"])
def test_the_tagged_processes_end_with_the_command(end):
    command = subprocess.Popen(
        [sys.executable, "-c", COMMAND, end], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": "."}
    )
    try:
        pids = json.loads(command.stdout.readline())
        ray = [pids[key] for key in ("tagged", "root", "child", "watchdog")]
        assert all(map(alive, ray))
        if end == "sigkill":
            command.send_signal(signal.SIGKILL)
        else:
            assert command.stdout.readline() == "stopped\n"  # stop() returns once the sweep is done
            assert not any(map(alive, ray))
        assert gone_within(ray, 10), {pid: alive(pid) for pid in ray}
        assert alive(pids["other"])
    finally:
        command.kill()
        command.wait()
        os.kill(pids["other"], signal.SIGKILL)
