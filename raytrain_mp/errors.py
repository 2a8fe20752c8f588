"""The two error types that reach the user as one line: a bad input (exit code 2) and a failed run (exit code 1).

Invariants: every bad input (option, file, data layout) is turned into a ``UsageError`` before any
cluster resource is requested or any output is written; the CLI prints ``raytrain-mp: error: <msg>``
on one line to stderr and exits with code 2, the same code argparse uses for unknown options. A run
that fails for good (its ``--max-failures`` restarts used up) raises ``RunFailedError``, which the
CLI prints as ``raytrain-mp: failed: <msg>`` on one line and exit code 1, without a traceback: the
message names what failed, when and why in a few words.
"""

from __future__ import annotations

from collections.abc import Mapping

EXIT_USAGE = 2
EXIT_FAILED = 1


class UsageError(ValueError):
    """A bad input the user can fix; its message is a single line naming the option or file."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class OptionError(UsageError):
    """A ``UsageError`` about one option of a Python API: says ``"option: detail"``; a command line
    that took the option as a flag says the same of its flag (``named``). ``mentions`` are other
    options the detail names, in its words, as ``(name)``."""

    def __init__(self, option: str, detail: str, mentions: tuple[str, ...] = ()) -> None:
        self.option, self.detail, self.mentions = option, " ".join(str(detail).split()), mentions
        super().__init__(f"{option}: {self.detail}")

    def named(self, names: Mapping[str, str]) -> UsageError:
        """The same error with the option, and each option it mentions, called by ``names``
        (Python name -> the caller's name; a name not in it stays)."""
        detail = self.detail
        for mention in self.mentions:
            detail = detail.replace(f"({mention})", f"({names.get(mention, mention)})")
        return UsageError(f"{names.get(self.option, self.option)}: {detail}")


class RunFailedError(RuntimeError):
    """A run that failed after using up its restarts; its message is one line: what failed, in
    which phase, why (e.g. ``its actor died: node lost``) and how many restarts it used."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))

    @classmethod
    def after_restarts(cls, what: str, used: int, allowed: int) -> RunFailedError:
        """``what`` failed with ``used`` of ``--max-failures allowed`` restarts behind it."""
        return cls(f"{what} ({used} restart{'s' * (used != 1)} used of --max-failures {allowed})")
