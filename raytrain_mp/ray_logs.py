"""What of Ray's logging reaches the terminal: quiet by default, everything with ``--verbose``.

The terminal shows the commands' own lines and Ray's warnings and errors. Ray's informational lines
stay in Ray's log files, and ``verbose`` brings them back. This is done with Ray's and Python's
logging settings, never by filtering output text:

- the driver: ``ray.init``'s ``logging_level`` and ``logging_config`` (``cluster.ray_connection``),
  and ``HARMLESS_NOTICES``, dropped there (``silence_harmless_notices``);
- Ray Train, whose own settings are environment variables (``quiet_ray_train_logs``);
- Ray Train's controller, an actor of its own: ``train_logs``.

``NoticeFilter`` is what both use to single out one notice of a logger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

# (logger, message start) of notices that say nothing a user must act on here: a locally started
# Ray enables token authentication by itself and says so at WARNING on every start.
HARMLESS_NOTICES = (("ray._private.authentication.authentication_token_setup", "Token authentication is enabled"),)


class NoticeFilter(logging.Filter):
    """What to do with one logger's records whose message starts with ``start`` (``filter``, in a
    subclass); ``install`` adds one to a logger once, however often it is called."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def matches(self, record: logging.LogRecord) -> bool:
        return record.getMessage().startswith(self.start)

    @classmethod
    def install(cls, notices: Sequence[tuple[str, str]]) -> None:
        """One filter for each (logger name, message start) of ``notices``."""
        for logger_name, start in notices:
            logger = logging.getLogger(logger_name)
            if not any(type(f) is cls and f.start == start for f in logger.filters):
                logger.addFilter(cls(start))


class _DropNotice(NoticeFilter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


def silence_harmless_notices() -> None:
    _DropNotice.install(HARMLESS_NOTICES)


def quiet_ray_train_logs() -> None:
    """Our rank-0 progress lines are the progress; Ray Train's print patch would echo each twice
    and its per-report log line repeats every metric. Users can set the variables to override."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING", "0")
