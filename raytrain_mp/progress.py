"""What a training run shows while it goes: a progress line with the ETA and the run's own lines,
on a terminal or off one.

- ``Progress`` is the clock of one attempt of a run (epochs x steps per epoch, starting after
  ``start_step`` global steps): after each step it says whether a line is due and writes it:
  ``epoch 2/5 step 37/120 loss 1.2345 samples/s 412.5 eta 0:12 (run 3:45)``. The epoch's ETA is
  its steps left at the mean step time of this epoch so far; the run's is the global steps left
  at the mean time per step of this attempt so far, which includes evaluation once an epoch ended.
- ``Console`` shows lines on one stream. On a terminal the progress line is redrawn in place
  (``\\r`` + text + erase to the end of the line) and a lasting line (an epoch's summary) first
  erases it; off a terminal (``ray job submit`` logs, CI, a pipe) progress appears only as plain
  lines every ``--log-every`` steps, and the output never holds ``\\r`` or an escape character.
  ``quiet`` shows nothing (``--quiet``: the command's summary alone, which ``cli.emit`` prints).
- ``note`` puts a ``note:`` line (advice, not an error) on stderr, also with ``--quiet``.

Invariants: a live update is due at most every ``LIVE_INTERVAL_S`` (so a fast loop spends no time
drawing, and a remote display is sent a few messages a second at most) and at every ``--log-every``
step; pure (no Ray), the clock is injectable, so the ETA is tested without sleeping.

Why not tqdm: its bar is one line per loop and knows neither the run's epochs around the epoch nor
a display in another process (a DDP run's rank 0 draws on the driver's terminal through ``ddp.
watch``); the two pieces it would replace here are the ETA arithmetic and the ``\\r`` redraw.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from raytrain_mp.readable import number

LIVE_INTERVAL_S = 0.5
ERASE_LINE = "\x1b[K"  # erase from the cursor to the end of the line (ANSI/VT100 EL)


def duration(seconds: float) -> str:
    """``12`` s as ``0:12``, ``225`` as ``3:45``, ``3725`` as ``1:02:05``."""
    whole = int(round(max(seconds, 0.0)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def log_interval(log_every: int | None, steps_per_epoch: int) -> int:
    """The steps between two ``--log-every`` lines and rows (0: none): as given, else 50, or about 4
    an epoch where an epoch is shorter, so that a short run still has a train curve. Logging reads
    the running loss and nothing else: the model is the same at any interval."""
    if log_every is not None:
        return log_every
    return min(50, max(1, steps_per_epoch // 4))


class Progress:
    """The progress of one attempt of a run of ``epochs`` epochs of ``steps_per_epoch`` steps of
    ``global_batch`` samples that starts after ``start_step`` global steps."""

    def __init__(
        self,
        epochs: int,
        steps_per_epoch: int,
        global_batch: int,
        start_step: int,
        log_every: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.epochs, self.steps_per_epoch, self.global_batch, self.log_every = (
            epochs,
            steps_per_epoch,
            global_batch,
            log_interval(log_every, steps_per_epoch),
        )
        self.clock = clock
        self.started = self.epoch_started = self.last_live = clock()
        self.start_step = self.epoch_start_step = start_step
        self.position = divmod(start_step, steps_per_epoch)  # (epoch, steps done in it), both from 0

    def start_epoch(self) -> None:
        """The epoch's clock starts now (after the previous epoch's evaluation and checkpoint)."""
        self.epoch_started = self.clock()
        self.epoch_start_step = self.done

    @property
    def at(self) -> tuple[int, int]:
        """(epoch, steps done in it), the epoch from 1, as the line names them."""
        return self.position[0] + 1, self.position[1]

    @property
    def done(self) -> int:
        """Global steps done."""
        return self.position[0] * self.steps_per_epoch + self.position[1]

    def step(self, global_step: int) -> str | None:
        """Record that ``global_step`` steps are done; ``"log"`` when this is a ``--log-every``
        step, ``"live"`` when a live update is due, else None."""
        self.position = divmod(global_step, self.steps_per_epoch)
        if (
            global_step % self.steps_per_epoch == 0
        ):  # the last step of an epoch: position (epoch, n), not (epoch + 1, 0)
            self.position = (global_step // self.steps_per_epoch - 1, self.steps_per_epoch)
        now = self.clock()
        if self.log_every and self.position[1] % self.log_every == 0:
            self.last_live = now
            return "log"
        if now - self.last_live >= LIVE_INTERVAL_S:
            self.last_live = now
            return "live"
        return None

    def line(self, loss: float) -> str:
        """The progress line at the current position, with the epoch's running ``loss``."""
        now = self.clock()
        epoch, step = self.position
        in_epoch = self.done - self.epoch_start_step
        epoch_rate = in_epoch / max(now - self.epoch_started, 1e-9)
        run_rate = (self.done - self.start_step) / max(now - self.started, 1e-9)
        left_in_epoch = self.steps_per_epoch - step
        left_in_run = self.epochs * self.steps_per_epoch - self.done
        eta = (
            f"eta {duration(left_in_epoch / epoch_rate)} (run {duration(left_in_run / run_rate)})"
            if in_epoch
            else "eta ?"
        )
        return (
            f"epoch {epoch + 1}/{self.epochs} step {step}/{self.steps_per_epoch} loss {number(loss)} "
            f"samples/s {epoch_rate * self.global_batch:.1f} {eta}"
        )


class Console:
    """Lines on ``stream`` (default stdout): lasting lines and a live progress line (see the module)."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.live = self.stream.isatty() if live is None else live
        self._drawn = False  # a live line is on the screen

    def say(self, text: str) -> None:
        """A lasting line (on a terminal it replaces the live line, which the next update redraws)."""
        if self.quiet:
            return
        self.stream.write(("\r" + ERASE_LINE if self._drawn else "") + text + "\n")
        self.stream.flush()
        self._drawn = False

    def progress(self, text: str, due: str, at: tuple[int, int] | None = None) -> None:
        """A progress update that ``Progress.step`` said is ``due`` (``"log"`` or ``"live"``) at
        ``Progress.at`` (kept by a display in another process, ``ddp.watch``)."""
        if self.quiet:
            return
        if self.live:
            self.stream.write("\r" + text + ERASE_LINE)
            self.stream.flush()
            self._drawn = True
        elif due == "log":
            self.say(text)

    def end_line(self) -> None:
        """Leave the live line as it is and move below it (the run stopped mid-epoch)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def note(line: str | None) -> None:
    """A ``note:`` line on stderr, where the tool's other notes go; None: nothing."""
    if line:
        print(line, file=sys.stderr, flush=True)
