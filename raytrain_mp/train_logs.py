"""What Ray Train's controller prints: the logging half of every ``RunConfig`` our commands build.

The controller is an actor of its own; its console lines reach the terminal through Ray's log
forwarding, past the driver's settings (``ray_logs``). Two settings reach it
(``run_config_logging``):

- the level of its console (``LoggingConfig``): INFO (resource requests, the worker group's table,
  checkpoint paths) only with ``--verbose``; WARNING and above always;
- ``DemoteTransientNotices``: the notices Ray Train itself calls safe to ignore when transient, a
  request to Ray's autoscaling coordinator that got no answer in its 5 s (a loaded machine, where
  the coordinator actor is still starting), become INFO records. Without it a newcomer's first run
  on a busy laptop ends in a 38-line traceback that means nothing.

Invariant: a record turned down here still reaches Ray Train's system log
(``logs/train/ray-train-sys-controller-*.log``), and ``verbose`` prints it. Apart from ``ray_logs``
because it imports Ray Train (Ray Data, pandas), which the pipeline's driver never needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ray.train import LoggingConfig
from ray.train.v2._internal.execution.callback import ControllerCallback

from raytrain_mp.ray_logs import NoticeFilter

# (logger, message start) of Ray Train's transient notices, each followed by a traceback.
_COORDINATOR_CLIENT = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
TRANSIENT_NOTICES = (
    (_COORDINATOR_CLIENT, "Failed to send resource request"),
    (_COORDINATOR_CLIENT, "Failed to cancel resource request"),
)


class _Demote(NoticeFilter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and self.matches(record):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def demote_transient_notices() -> None:
    """Make this process's ``TRANSIENT_NOTICES`` INFO records (idempotent)."""
    _Demote.install(TRANSIENT_NOTICES)


def _unpickled_in_the_controller() -> DemoteTransientNotices:
    demote_transient_notices()
    return DemoteTransientNotices()


class DemoteTransientNotices(ControllerCallback):
    """Installs ``demote_transient_notices`` in the controller. The first resource request comes from
    the controller's first hook, before any callback of ours runs there; what runs earlier is the
    unpickling of its constructor's arguments, this callback among them."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _unpickled_in_the_controller, ()


def run_config_logging(verbose: bool, callbacks: Sequence[object] = ()) -> dict[str, Any]:
    """``RunConfig`` keyword arguments: its ``logging_config``, and ``callbacks`` (a run's own, then
    ``DemoteTransientNotices``)."""
    return {
        "logging_config": LoggingConfig(log_level="INFO" if verbose else "WARNING"),
        "callbacks": [*callbacks, DemoteTransientNotices()],
    }
