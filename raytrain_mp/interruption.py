"""Ctrl-C (SIGINT), SIGTERM and SIGHUP during a command: stop it with an exception that carries
where the run stands.

- ``signals_interrupt()`` makes SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session)
  raise ``Interrupted`` in the main thread while a command runs (Python's own SIGINT handling
  raises ``KeyboardInterrupt``; SIGTERM's and SIGHUP's defaults kill the process without any
  cleanup). ``Interrupted`` is a ``BaseException``, as ``KeyboardInterrupt`` is, so no
  ``except Exception`` on its way treats it as a failure to retry. SIGKILL cannot be caught; the
  local Ray the command started ends with it all the same (``watchdog``).
- A training command adds what it knows as the exception passes (``Interrupted.at``, the run
  folder); ``cli`` prints ``checkpointing.interrupted_line`` of it once the command
  has unwound, which has stopped the workers and shut down a local Ray the command started
  (``cluster.ray_connection``), and exits with 128 + the signal's number (130, 143, 129), the status a
  shell reports for a process that signal ended.
- Inside Ray's Cython calls (``ray.wait``, ``ray.get``) the handler's ``Interrupted`` comes out as
  a ``SystemError`` whose cause it is; ``carried_signal`` finds it, and the run loops and ``cli``
  treat that as the ``Interrupted`` itself.
- A second signal while the first unwinds ends the process at once, without cleanup, with that
  signal's status: the way out of a shutdown that hangs.
- ``uninterrupted()`` holds a signal back until its block ends: a write that a signal cut between
  opening an object and writing its bytes would otherwise leave an empty object behind (closing
  an S3 stream, as leaving its ``with`` does, uploads what it holds), and a local one a stray
  temporary file.

Below ``storage`` (whose writes are ``uninterrupted``): this module imports no other of the package,
so it knows the run folder an ``Interrupted`` carries only as a value, and what the run's
checkpoints say is ``checkpointing``'s to tell.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """The command was stopped by signal ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.at: tuple[int, int] | None = None  # (epoch, step in it), both from 1, of the last step known done
        self.run: Any = None  # the run folder, a ``storage.Location``, or None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def carried_signal(exc: BaseException) -> Interrupted | None:
    """The ``Interrupted`` that ``exc`` is or carries, else None. Ray's Cython calls (``ray.wait``,
    ``ray.get``) run Python's signal handlers while they wait, and one whose handler raised ends
    as ``SystemError: ... returned a result with an exception set``, the ``Interrupted`` its cause."""
    if isinstance(exc, Interrupted):
        return exc
    if isinstance(exc, SystemError) and isinstance(exc.__cause__, Interrupted):
        return exc.__cause__
    return None


_held: int | None = None  # the first signal that came inside uninterrupted()
_holding = 0  # the depth of uninterrupted() blocks


def _raise(signum: int, frame) -> None:
    global _held
    if _holding:
        _held = _held or signum
        return
    for each in SIGNALS:  # the next signal ends the process (see the module docstring)
        signal.signal(each, lambda number, _frame: os._exit(128 + number))
    raise Interrupted(signum)


_armed = False  # inside signals_interrupt()


def rearm() -> None:
    """Within ``signals_interrupt``, make its handlers the process's again: ``ray.init`` installs
    SIGTERM handlers of its own, in Python (``sys.exit(15)``) and in C (a stack trace, then abort)."""
    if _armed:
        for each in SIGNALS:
            signal.signal(each, _raise)


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` in the main thread while the block runs."""
    global _armed
    previous = {each: signal.signal(each, _raise) for each in SIGNALS}
    _armed = True
    try:
        yield
    finally:
        _armed = False
        for each, handler in previous.items():
            signal.signal(each, handler)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Run the block whole: a signal that comes meanwhile raises ``Interrupted`` as it ends."""
    global _holding, _held
    _holding += 1
    try:
        yield
    finally:  # also when the block failed: the signal is what the user asked for
        _holding -= 1
        if not _holding and _held:
            signum, _held = _held, None
            _raise(signum, None)
