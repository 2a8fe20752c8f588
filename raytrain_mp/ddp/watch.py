"""A DDP run's lines on the terminal of the command that started it.

Rank 0 runs in a Ray worker; Ray forwards its output line by line, prefixed, to the driver, so it
cannot redraw a live line there, and a forwarded line would cut through one the driver draws. So
``raytrain-mp ddp`` creates a ``Board`` actor for the run (a named actor in the job's namespace),
rank 0 sends its lines to it (``rank_zero_console``), and the driver's main thread shows them on
its ``progress.Console`` while ``TorchTrainer.fit`` runs on another thread (``Watch.fit``).

Invariants:
- Without a board (a Tune trial: the sweep's driver shows its own table) rank 0 prints plain lines
  itself, as off a terminal.
- Rank 0 sends at most what ``progress.Progress`` makes due (a few updates a second), each a
  fire-and-forget call: a step never waits for the driver.
- The board keeps the position of the last step shown, which an interrupt's line names.
- A board whose process dies is restarted by Ray: the run goes on, losing only the lines then in
  flight and the position until the next update.
- ``fit`` runs off the main thread, so Ray Train does not install its own SIGINT handler (it does
  so only on the main thread) and ``interruption`` decides what Ctrl-C does; the fit's outcome,
  result or exception, is the call's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_mp.progress import Console

R = TypeVar("R")
BOARD_PREFIX = "raytrain-mp-lines:"
POLL_S = 0.2
CLOSE_TIMEOUT_S = 10.0


@ray.remote(num_cpus=0)
class Board:
    """Lines from rank 0 to the driver: (kind, text) in order, and the last step position shown."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.position: tuple[int, int] | None = None

    def put(self, kind: str, text: str, position: tuple[int, int] | None) -> None:
        self.lines.append((kind, text))
        self.position = position or self.position

    def take(self) -> tuple[list[tuple[str, str]], tuple[int, int] | None]:
        lines, self.lines = self.lines, []
        return lines, self.position


class BoardConsole:
    """``progress.Console``'s calls, sent to the driver's board."""

    def __init__(self, board) -> None:
        self.board = board

    def say(self, text: str) -> None:
        self.board.put.remote("say", text, None)

    def progress(self, text: str, due: str, position: tuple[int, int] | None = None) -> None:
        self.board.put.remote(due, text, position)


def rank_zero_console(run_name: str, quiet: bool) -> Console | BoardConsole:
    """Where rank 0's lines go: the board of the command that started the run, else its own stdout."""
    try:
        return BoardConsole(ray.get_actor(BOARD_PREFIX + run_name))
    except ValueError:
        return Console(quiet=quiet, live=False)


class Watch:
    """The driver's side: a board for the run named ``run_name``, shown on ``console``."""

    def __init__(self, run_name: str, console: Console) -> None:
        self.console = console
        self.name = BOARD_PREFIX + run_name
        # On the driver's node, as Ray Train places its controller: a lost worker node must not take it along.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # Restarted by Ray if its process dies (its lines in flight are lost, the handles rank 0
        # holds stay valid): a lost board must not end a run that trains on.
        self.board = Board.options(
            name=self.name, scheduling_strategy=here, max_restarts=-1, max_task_retries=-1
        ).remote()
        self.position: tuple[int, int] | None = None

    def show(self) -> None:
        lines, self.position = ray.get(self.board.take.remote())
        for kind, text in lines:
            if kind == "say":
                self.console.say(text)
            else:
                self.console.progress(text, kind)

    def fit(self, fit: Callable[[], R]) -> R:
        """``fit()`` on a thread, showing the board's lines until it returns; its result or exception."""
        outcome: dict = {}

        def target() -> None:
            try:
                outcome["result"] = fit()
            except BaseException as exc:  # handed to the main thread, which raises it
                outcome["error"] = exc

        thread = threading.Thread(
            target=target, name="raytrain-mp-fit", daemon=True
        )  # daemon: an interrupt does not wait for it
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            self.show()
        self.close()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def close(self) -> None:
        """End the board and wait until its name is free: a rerun of the run in this process (a
        test's, a notebook's) names its board the same."""
        ray.kill(self.board)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(self.name)
            except ValueError:
                return
            time.sleep(POLL_S / 4)
