"""A run's record of its training, kept in the run folder (``STORAGE/NAME``, local or object store)
beside its checkpoints: what a person reads while the run goes and after it ends.

- ``metrics.csv``: one ``step`` row every ``--log-every`` steps (global step, epoch, the epoch's
  running train loss, lr, samples/s since the previous row, for the pipeline the bubble so far in
  the epoch) and one ``epoch`` row per epoch (its train loss, lr, samples/s, bubble, val loss and
  accuracy). ``global_step`` counts the steps done when the row was written.
- ``events.out.tfevents.*``: the same numbers as TensorBoard scalars by global step (``train/loss``,
  ``train/lr``, ... for step rows; ``epoch/...`` and ``val/loss``, ``val/accuracy`` for epoch
  rows), so ``tensorboard --logdir STORAGE`` shows every run and every Tune trial side by side.
- ``curves.png``: loss, val accuracy and lr against the global step, drawn at every epoch end and
  when the run ends (Tune ends a trial as soon as its scheduler has the last epoch's report, before
  the loop's end). The lr panel draws the run's schedule at every step done (``lr_at``, so a warmup
  of a few steps shows), not only at the rows; a legend names only lines that have points.

Invariants:

- One writer a run: rank 0 of a DDP run (a Tune trial is one), the driver of a pipeline run.
- Never torn: ``publish`` replaces the whole CSV and the whole event file of this attempt, each one
  ``Location.write_bytes`` (a rename locally, one PUT on object stores). The event file is written
  into a local temporary folder and uploaded whole, so object stores get events too.
- The run publishes before every checkpoint it writes and at every epoch end, so the published log
  covers at least every step of the newest checkpoint. A resumed attempt starting after S global
  steps (a crash under ``--max-failures``, a rerun of the name, a mid-epoch checkpoint) keeps the
  published CSV's rows with ``global_step <= S`` and appends: no step is missing or twice. Its
  event file is new and opens with ``purge_step`` S + 1 (a ``SessionLog.START`` there, as
  tensorboardX's ``SummaryWriter(purge_step=...)`` writes it), so TensorBoard drops earlier files'
  events after step S, which the crashed attempt may have published.

Why tensorboardX and not ``torch.utils.tensorboard``: the latter needs the ``tensorboard`` package,
which is large and not a dependency; tensorboardX is already installed with Ray Tune. Its
synchronous ``EventsWriter`` is used rather than ``SummaryWriter``, whose background thread gives no
way to know that an event reached the file before the file is published.

With ``--mlflow`` the log's writer also sends each row to the run's MLflow run when it publishes
(``tracking.Tracker``: each metric's steps once, also across attempts).
"""

from __future__ import annotations

import csv
import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import scalar

from raytrain_mp.plots import png_bytes, pyplot
from raytrain_mp.storage import Location
from raytrain_mp.tracking import Tracker

METRICS_FILE = "metrics.csv"
CURVES_FILE = "curves.png"
COLUMNS = (
    "kind",
    "global_step",
    "epoch",
    "train_loss",
    "lr",
    "samples_per_second",
    "bubble_fraction",
    "val_loss",
    "val_accuracy",
    "val_loss_ema",
    "val_accuracy_ema",
)
# The TensorBoard tag of each number column, by row kind.
TAGS = {
    "step": {"train_loss": "train/loss", "lr": "train/lr", "samples_per_second": "train/samples_per_second",
             "bubble_fraction": "train/bubble_fraction"},
    "epoch": {"train_loss": "epoch/train_loss", "lr": "epoch/lr", "samples_per_second": "epoch/samples_per_second",
              "bubble_fraction": "epoch/bubble_fraction", "val_loss": "val/loss", "val_accuracy": "val/accuracy",
              "val_loss_ema": "val_ema/loss", "val_accuracy_ema": "val_ema/accuracy"},
}  # fmt: skip


def read_rows(run: Location) -> list[dict[str, str]]:
    """The rows of the run's published ``metrics.csv`` (none when there is none)."""
    file = run.child(METRICS_FILE)
    if not file.is_file():
        return []
    return list(csv.DictReader(io.StringIO(file.read_bytes().decode())))


class RunLog:
    """The log of one attempt of a run at ``run`` that starts after ``start_step`` global steps of
    ``global_batch`` samples each (see the module's invariants); ``lr_at(s)``: the lr the step from
    0 ``s`` trains with (the run's ``LRSchedule``), for ``curves.png``; ``tracker``: the run's
    MLflow run (``--mlflow``), which gets every row published."""

    def __init__(
        self,
        run: Location,
        start_step: int,
        global_batch: int,
        lr_at: Callable[[int], float] | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        self.run, self.global_batch, self.lr_at, self.tracker = run, global_batch, lr_at, tracker
        self.rows = [row for row in read_rows(run) if int(row["global_step"]) <= start_step]
        self._published = -1  # rows published so far (-1: not even the truncation)
        self._local = tempfile.TemporaryDirectory(prefix="raytrain-log-")  # removed with the log, also an abandoned one
        # The suffix keeps name order = start order, also for attempts within one second.
        self._events = EventsWriter(str(Path(self._local.name) / "events"), f".from-{start_step:09d}")
        # purge_step: rows up to start_step stay, events at later steps from earlier files go.
        self._events.write_event(
            Event(wall_time=time.time(), step=start_step + 1, session_log=SessionLog(status=SessionLog.START))
        )
        self._last_step, self._last_time = start_step, time.perf_counter()

    def step(
        self, global_step: int, epoch: int, train_loss: float, lr: float, bubble_fraction: float | None = None
    ) -> None:
        """A row after ``global_step`` steps (in epoch ``epoch``, from 1); samples/s is timed since the previous row."""
        now = time.perf_counter()
        rate = (global_step - self._last_step) * self.global_batch / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = global_step, now
        numbers = {"train_loss": train_loss, "lr": lr, "samples_per_second": rate, "bubble_fraction": bubble_fraction}
        self._add("step", global_step, epoch, numbers)

    def epoch(self, global_step: int, metrics: dict) -> None:
        """The row of the epoch ``metrics["epoch"]`` that ended after ``global_step`` steps (the
        columns ``metrics`` has), then ``publish`` and ``draw``; the next step row is timed from
        here, after evaluation."""
        self._add("epoch", global_step, metrics["epoch"], {name: metrics.get(name) for name in TAGS["epoch"]})
        self._last_step, self._last_time = global_step, time.perf_counter()
        self.publish()
        self.draw()

    def _add(self, kind: str, global_step: int, epoch: int, numbers: dict[str, float | None]) -> None:
        present = {name: float(value) for name, value in numbers.items() if value is not None}
        self.rows.append(
            {
                "kind": kind,
                "global_step": str(global_step),
                "epoch": str(epoch),
                **{k: repr(v) for k, v in present.items()},
            }
        )
        summary = Summary(
            value=[value for name, number in present.items() for value in scalar(TAGS[kind][name], number).value]
        )
        self._events.write_event(Event(wall_time=time.time(), step=global_step, summary=summary))

    def publish(self) -> None:
        """Replace the run's CSV and this attempt's event file with everything logged so far
        (nothing to do when no row came since the last time)."""
        if self._published == len(self.rows):
            return
        text = io.StringIO()
        writer = csv.DictWriter(text, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        self.run.child(METRICS_FILE).write_bytes(text.getvalue().encode())
        self._events.flush()
        (events,) = Path(self._local.name).glob(
            "events.out.tfevents.*"
        )  # tensorboardX names it (time, host, our suffix)
        self.run.child(events.name).write_bytes(events.read_bytes())
        if self.tracker is not None:
            self.tracker.log(self.rows[max(self._published, 0) :])
        self._published = len(self.rows)

    def draw(self) -> None:
        """Replace the run's ``curves.png`` with one of every row so far."""
        self.run.child(CURVES_FILE).write_bytes(plot_curves(self.rows, self.lr_at))

    def close(self) -> None:
        """Publish, draw ``curves.png`` and remove the local copy; the run ended."""
        self.publish()
        self.draw()
        self._events.close()
        self._local.cleanup()


# At most this many points of the lr schedule are drawn: every step of a short run, a sample of a long one.
LR_POINTS = 2000


def plot_curves(rows: list[dict[str, str]], lr_at: Callable[[int], float] | None = None) -> bytes:
    """A PNG of train and val loss, val accuracy and lr against the global step; the lr by
    ``lr_at`` at every step done (see ``RunLog``), else the rows' lr."""
    plt = pyplot()

    def series(kind: str, name: str) -> tuple[list[int], list[float]]:
        points = [(int(r["global_step"]), float(r[name])) for r in rows if r["kind"] == kind and r.get(name)]
        return [s for s, _ in points], [v for _, v in points]

    fig, (loss, accuracy, lr) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for kind, name, style, label in (
        ("step", "train_loss", "-", "train (running mean of the epoch)"),
        ("epoch", "train_loss", "o-", "train (epoch)"),
        ("epoch", "val_loss", "s-", "val"),
    ):
        steps, values = series(kind, name)
        if steps:  # a line without points would be an empty legend entry
            loss.plot(steps, values, style, label=label, alpha=0.6 if kind == "step" else 1.0)
    loss.set_ylabel("loss")
    if loss.lines:
        loss.legend()
    accuracy.plot(*series("epoch", "val_accuracy"), "s-", label="model")
    ema_steps, ema_values = series("epoch", "val_accuracy_ema")
    if ema_steps:  # --model-ema
        accuracy.plot(ema_steps, ema_values, "d--", label="weight average (EMA)")
        accuracy.legend()
    accuracy.set_ylabel("val accuracy")
    done = max((int(r["global_step"]) for r in rows), default=0)
    if lr_at is not None and done:
        points = min(done, LR_POINTS)
        steps = sorted({1 + round(i * (done - 1) / max(points - 1, 1)) for i in range(points)})
        lr.plot(steps, [lr_at(s - 1) for s in steps])  # global step s: the step from 0 s - 1 trained with it
    else:
        by_step = series("step", "lr")
        lr.plot(*(by_step if by_step[0] else series("epoch", "lr")))  # without step rows, the epochs' last lr
    lr.set_ylabel("lr")
    lr.set_xlabel("global step")
    for ax in (loss, accuracy, lr):
        ax.grid(alpha=0.3)
    return png_bytes(fig)
