"""``niceness.run_at_normal_niceness``: every thread of the process, the ones started before the
call included, ends at torchrun's niceness where the OS allows it, and keeps its own where not."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

# A process niced as Ray nices a worker, with a thread started before the call (as Ray Train's
# training thread and gloo's are); it prints every thread's niceness after the call.
PROGRAM = """
import json, os, threading
from pathlib import Path
from raytrain_mp.niceness import run_at_normal_niceness
os.setpriority(os.PRIO_PROCESS, 0, 15)  # as Ray sets its workers, whatever the runner's niceness
started, stop = threading.Event(), threading.Event()
def wait():
    started.set()
    stop.wait()
thread = threading.Thread(target=wait)
thread.start()
started.wait()
before = sorted(os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path("/proc/self/task").iterdir())
got = run_at_normal_niceness()
after = sorted(os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path("/proc/self/task").iterdir())
stop.set()
thread.join()
print(json.dumps({"before": before, "got": got, "after": after}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread niceness is Linux's")
def test_every_thread_runs_at_torchruns_niceness_where_allowed() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True)
    niceness = json.loads(done.stdout)
    threads = len(niceness["before"])
    assert threads >= 2 and niceness["before"] == [15] * threads
    allowed = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    expected = 0 if allowed else 15
    assert niceness["got"] == expected and niceness["after"] == [expected] * threads
