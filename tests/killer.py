"""SIGKILLs from outside, as an operator's ``kill -9`` or a lost spot instance deals them: a thread
that kills the Ray worker processes of this test process's own Ray by their title
(``ray::StageWorker``, ``ray::RayTrainWorker``, ``ray::Board``), at moments a seeded random
generator or an event picks.

Only descendants of this process are candidates: the Ray that ``ray.init`` started here (the
session's, or a command's local one) runs its raylet, and so its workers, as children of this
process, so another xdist worker's Ray is never touched.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

POLL_S = 0.02


def titled(prefix: str, root: int | None = None) -> dict[int, str]:
    """pid -> title of the live descendants of ``root`` (this process by default) whose process
    title starts with ``prefix``."""
    found = {}
    for process in psutil.Process(root or os.getpid()).children(recursive=True):
        try:
            cmdline = process.cmdline()  # once: a process that ends between two calls has an empty one
            title = cmdline[0] if cmdline else ""
            if title.startswith(prefix) and process.status() != psutil.STATUS_ZOMBIE:
                found[process.pid] = title
        except psutil.Error:  # it ended while we looked
            continue
    return found


def kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


@dataclass
class Killer:
    """Kills processes titled ``prefix`` under ``root`` from a daemon thread; ``kills`` lists
    (seconds since start, pid, title, why) of each kill made."""

    prefix: str
    root: int | None = None
    kills: list[tuple[float, int, str, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _started: float = 0.0

    def start(self, plan: Callable[[], None]) -> Killer:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=plan, name="killer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, int, str, str]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        return self.kills

    def __enter__(self) -> Killer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait(self, condition: Callable[[], object], timeout_s: float = 600.0) -> object:
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if value := condition():
                return value
            time.sleep(POLL_S)
        return None

    def _kill(self, pid: int, title: str, why: str) -> None:
        if kill(pid):
            self.kills.append((round(time.monotonic() - self._started, 2), pid, title, why))

    def kill_first_new(self, after: Callable[[], bool] = lambda: True, why: str = "as it starts") -> None:
        """Once ``after()`` holds, kill the first process with the title that was not there then
        (one of the stage actors a restart builds, as soon as it exists)."""
        if not self._wait(after):
            return
        before = set(titled(self.prefix, self.root))
        found = self._wait(lambda: {p: t for p, t in titled(self.prefix, self.root).items() if p not in before})
        if found:
            pid = min(found)
            self._kill(pid, found[pid], why)

    def kill_at_random(
        self,
        seed: int,
        faults: int,
        gap_s: tuple[float, float],
        rebuild_every: int = 0,
        checkpoints: Path | None = None,
    ) -> None:
        """``faults`` kills of a random process with the title. Each comes ``gap_s`` (uniform)
        seconds after such processes exist, or, with ``checkpoints`` (a run folder) for every
        other one on average, that long after the run publishes a checkpoint it had not before:
        the first kind lands mostly in start-ups, the second in steps, evaluations and checkpoint
        writes, and the run gets on between them. With ``rebuild_every`` k, every k-th kill is
        followed by one of the next new process (a kill during the restart the last one caused)."""
        rng = random.Random(seed)
        for fault in range(1, faults + 1):
            why = f"random {fault}"
            if checkpoints is not None and rng.random() < 0.5:
                published = set(Path(checkpoints).glob("checkpoint_*"))
                if not self._wait(lambda: set(Path(checkpoints).glob("checkpoint_*")) - published):
                    return
                why += " after a new checkpoint"
            elif not self._wait(lambda: titled(self.prefix, self.root)):
                return
            if self._stop.wait(rng.uniform(*gap_s)):
                return
            alive = self._wait(lambda: titled(self.prefix, self.root))
            if not alive:
                return
            before = set(alive)
            pid = rng.choice(sorted(alive))
            self._kill(pid, alive[pid], why)
            if rebuild_every and fault % rebuild_every == 0:
                found = self._wait(lambda: {p: t for p, t in titled(self.prefix, self.root).items() if p not in before})
                if found:
                    pid = min(found)
                    self._kill(pid, found[pid], f"during the restart after random {fault}")


def exists(path: Path) -> Callable[[], bool]:
    return lambda: Path(path).exists()
