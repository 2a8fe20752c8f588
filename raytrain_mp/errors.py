"""The one error type that reaches the user as a one-line message and exit code 2.

Invariant: every bad input (option, file, data layout) is turned into a ``UsageError`` before any
cluster resource is requested or any output is written; the CLI prints ``raytrain-mp: error: <msg>``
on one line to stderr and exits with code 2, the same code argparse uses for unknown options.
"""

from __future__ import annotations

EXIT_USAGE = 2


class UsageError(ValueError):
    """A bad input the user can fix; its message is a single line naming the option or file."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
