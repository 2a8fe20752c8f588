"""The niceness a training rank runs at: 0, as a torchrun rank does, not the 15 Ray gives its workers.

Job: ``run_at_normal_niceness`` asks the OS for niceness 0 for every thread of the calling process.
Ray starts its worker processes at niceness 15 (``RAY_worker_niceness``) so that its own daemons
stay responsive on a busy node. A training rank is on the other ranks' critical path (a pipeline
stage waits for its neighbours' activations and gradients, a DDP rank for the all-reduce), so each
time the OS runs another process (a Ray daemon, the driver, a neighbour) instead of one rank, all
of them wait; a torchrun rank, at 0, does not give way to those.

Invariants:
- Never raises. Lowering niceness needs CAP_SYS_NICE or an RLIMIT_NICE that allows it; where
  neither is given, every thread keeps the niceness it had (start the cluster with
  ``RAY_worker_niceness=0`` to get the same).
- On Linux niceness belongs to each thread and a new thread inherits its creator's: Ray lowers its
  worker's main thread, and the threads that thread already started (Ray Train's training thread,
  gloo's) carry 15 too, so every thread of ``/proc/self/task`` is set. Elsewhere the process's
  niceness is set.
"""

from __future__ import annotations

import os
from pathlib import Path

TORCHRUN_NICENESS = 0


def run_at_normal_niceness() -> int:
    """Set every thread of this process to niceness 0 where the OS allows; the calling thread's
    niceness afterwards."""
    tasks = Path("/proc/self/task")
    threads = [int(task.name) for task in tasks.iterdir()] if tasks.is_dir() else [0]
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, TORCHRUN_NICENESS)
        except (PermissionError, ProcessLookupError):  # not allowed, or the thread ended meanwhile
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)
