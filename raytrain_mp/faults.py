"""Why a Ray actor or task failed, in a few words: the cause a run's one-line error ends with.

Ray's own messages for a dead actor run to a paragraph (the actor's ids, then a reason, then, for
a process that vanished, advice about the OOM killer and resource isolation), and a task's error
carries the remote traceback. A user deciding whether to rerun needs only the reason: ``killed by
ray.kill``, ``node lost``, ``exit code 1 (SIGTERM)``, or the exception raised inside.

Invariants: ``short_cause`` is one line, never Ray's traceback, and names a cause Ray did give
(the rules match the reasons Ray 2.60's GCS and raylet write, checked in ``tests/test_faults.py``
against real dead actors); an unknown message falls back to its first line, so a new Ray never
turns a cause into nothing.
"""

from __future__ import annotations

import re

from ray.exceptions import NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError

# A process that ended with no word to its raylet: its socket closed ("End of file").
ABRUPT = "its process died abruptly (SIGKILL, the OOM killer or a crash)"
# (what Ray's message says, the cause), the first match wins.
_REASONS = (
    ("killed by `ray.kill`", "killed by ray.kill"),
    ("its node has died", "node lost"),
    ("its owner has died", "its owner died"),
    ("low on memory", "killed by Ray's memory monitor (its node ran low on memory)"),
    ("connection error code 2", ABRUPT),
)
_EXIT_CODE = re.compile(r"exit code (-?\d+)")


def actor_death(message: str) -> str:
    """The reason in Ray's message for a dead actor (``RayActorError``), in a few words."""
    for said, cause in _REASONS:
        if said in message:
            return cause
    if code := _EXIT_CODE.search(message):
        return f"exit code {code.group(1)}" + (" (SIGTERM)" if "SIGTERM" in message else "")
    return first_line(message)


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def short_cause(error: BaseException) -> str:
    """One line on why ``error`` ended a Ray call: ``its actor died: <reason>``, ``node lost``,
    ``its process died abruptly ...`` for a task's, or the type and first line of an exception
    raised inside the call (without Ray's traceback)."""
    if isinstance(error, RayActorError):
        return f"its actor died: {actor_death(str(error))}"
    if isinstance(error, NodeDiedError):
        return "node lost"
    if isinstance(error, WorkerCrashedError):
        return ABRUPT
    if isinstance(error, RayTaskError):
        error = error.cause  # what was raised inside, without Ray's traceback
    return f"{type(error).__name__}: {first_line(str(error)) or repr(error)}"
