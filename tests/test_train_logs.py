"""``train_logs``: the callback that demotes Ray Train's transient notices does so in the process
that unpickles it (Ray Train's controller), and to those notices alone."""

from __future__ import annotations

import logging
import pickle

from raytrain_mp.train_logs import TRANSIENT_NOTICES, DemoteTransientNotices, run_config_logging


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname, record.getMessage()))


def test_unpickling_the_callback_demotes_the_transient_notices_to_info_and_nothing_else():
    logger_name = TRANSIENT_NOTICES[0][0]
    logger = logging.getLogger(logger_name)
    records = Records()
    logger.addHandler(records)
    try:
        logger.warning("Failed to send resource request for train-1. It is safe to ignore.")
        pickle.loads(pickle.dumps(DemoteTransientNotices()))
        pickle.loads(pickle.dumps(DemoteTransientNotices()))  # a second unpickling adds no second filter
        logger.warning("Failed to send resource request for train-2. It is safe to ignore.")
        logger.warning("Failed to cancel resource request for train-2. It expires.")
        logger.warning("Something else went wrong")
        logger.error("Failed to send resource request, at ERROR")
    finally:
        logger.removeHandler(records)
        logger.filters.clear()
    assert records.seen == [
        ("WARNING", "Failed to send resource request for train-1. It is safe to ignore."),
        ("INFO", "Failed to send resource request for train-2. It is safe to ignore."),
        ("INFO", "Failed to cancel resource request for train-2. It expires."),
        ("WARNING", "Something else went wrong"),
        ("ERROR", "Failed to send resource request, at ERROR"),  # Ray Train says so at WARNING; an ERROR is news
    ]


def test_run_config_logging_sets_the_console_level_and_puts_the_callback_after_the_runs_own():
    own = object()
    quiet, verbose = run_config_logging(False, [own]), run_config_logging(True)
    assert quiet["logging_config"].log_level == "WARNING" and verbose["logging_config"].log_level == "INFO"
    assert quiet["callbacks"][0] is own and isinstance(quiet["callbacks"][1], DemoteTransientNotices)
    assert [type(c) for c in verbose["callbacks"]] == [DemoteTransientNotices]
