"""The run log (``run_log``): rows, the truncation a resume makes, whole-file publishing, and
TensorBoard events that carry the CSV's numbers, locally and on an S3 store. No Ray, no training.
"""

from __future__ import annotations

import csv
import io

import pytest

from raytrain_mp.run_log import CURVES_FILE, METRICS_FILE, RunLog, read_rows
from raytrain_mp.storage import Location, join, locate

from run_log_check import csv_as_events, read_events

EPOCH_METRICS = {
    "epoch": 1,
    "train_loss": 1.25,
    "val_loss": 1.5,
    "val_accuracy": 0.625,
    "samples_per_second": 100.0,
    "lr": 0.1,
    "world_size": 2,
    "world_size_history": [[0, 2]],
}


def attempt(run: Location, start: int, steps: range, loss: float, publish_at: int | None = None) -> RunLog:
    """An attempt logging ``steps`` (4 a epoch, an epoch row at each epoch end), publishing after
    ``publish_at`` as a checkpoint would."""
    log = RunLog(run, start, global_batch=32)
    for step in steps:
        log.step(step, (step - 1) // 4 + 1, loss + step, lr=0.1 * step)
        if step % 4 == 0:
            log.epoch(step, {**EPOCH_METRICS, "epoch": step // 4})
        if step == publish_at:
            log.publish()
    return log


@pytest.fixture(params=["local", "s3"])
def run(request, tmp_path) -> Location:
    if request.param == "local":
        return locate(str(tmp_path / "runs"), "--storage-path").child("r")
    return locate(join(request.getfixturevalue("bucket"), "runs"), "--storage-path").child("r")


def test_rows_events_and_curves(run):
    attempt(run, 0, range(1, 7), loss=1.0).close()
    rows = read_rows(run)
    assert [(r["kind"], r["global_step"], r["epoch"]) for r in rows] == [
        ("step", "1", "1"), ("step", "2", "1"), ("step", "3", "1"), ("step", "4", "1"), ("epoch", "4", "1"),
        ("step", "5", "2"), ("step", "6", "2"),
    ]  # fmt: skip
    assert float(rows[2]["train_loss"]) == 4.0 and float(rows[2]["lr"]) == 0.1 * 3  # full precision
    assert float(rows[0]["samples_per_second"]) > 0 and rows[0]["val_loss"] == ""
    assert (rows[4]["val_accuracy"], rows[4]["val_loss"], rows[4]["train_loss"]) == ("0.625", "1.5", "1.25")
    events = read_events(run)
    want = csv_as_events(rows)
    assert events.keys() == want.keys() and {"train/loss", "train/lr", "val/loss", "val/accuracy"} <= {
        tag for tag, _ in events
    }
    assert all(
        events[key] == pytest.approx(value, rel=1e-6) for key, value in want.items()
    )  # TensorBoard holds float32
    assert run.child(CURVES_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resume_continues_the_log_without_duplicated_or_missing_steps(run):
    # Attempt 1 publishes after step 6 (a checkpoint) and after 8 (the epoch's end, a checkpoint
    # Ray never registered), logs step 9 and dies. Attempt 2 resumes from the checkpoint after step 6.
    first = attempt(run, 0, range(1, 10), loss=1.0, publish_at=6)
    del first  # abandoned, as a crashed attempt's log is
    attempt(run, 6, range(7, 13), loss=2.0).close()
    rows = read_rows(run)
    steps = [int(r["global_step"]) for r in rows if r["kind"] == "step"]
    assert steps == list(range(1, 13))
    assert [int(r["global_step"]) for r in rows if r["kind"] == "epoch"] == [4, 8, 12]
    assert [float(r["train_loss"]) for r in rows if r["kind"] == "step"] == [1.0 + s for s in range(1, 7)] + [
        2.0 + s for s in range(7, 13)
    ]
    events = read_events(run)
    assert events == pytest.approx(csv_as_events(rows), rel=1e-6)  # the crashed attempt's steps 7 and 8 purged


def test_publishing_replaces_whole_files(tmp_path, monkeypatch):
    """Every write of ``metrics.csv`` is the complete file (one atomic ``write_bytes``): a reader
    or a crash never meets half of it, and nothing is appended to an old copy."""
    writes: list[tuple[str, bytes]] = []
    original = Location.write_bytes
    monkeypatch.setattr(
        Location, "write_bytes", lambda self, data: (writes.append((self.path, data)), original(self, data))[1]
    )
    run = locate(str(tmp_path / "runs"), "--storage-path").child("r")
    attempt(run, 0, range(1, 6), loss=1.0, publish_at=2).publish()
    csv_writes = [data for path, data in writes if path.endswith(METRICS_FILE)]
    assert [len(list(csv.DictReader(io.StringIO(data.decode())))) for data in csv_writes] == [2, 5, 6]
    assert sorted(p.name for p in (tmp_path / "runs" / "r").iterdir() if p.name.startswith(".tmp-")) == []


def test_curves_have_no_empty_legend_entry_and_the_lr_of_every_step(monkeypatch):
    from raytrain_mp import run_log
    from raytrain_mp.lr_schedule import make_schedule

    figures = []
    monkeypatch.setattr(run_log, "png_bytes", lambda fig: figures.append(fig) or b"")
    schedule = make_schedule(0.1, 512, 256, "linear", 1.0, 2, 5, "cosine")  # a 5-step warmup, 10 steps
    epoch_rows = [
        {"kind": "epoch", "global_step": str(5 * e), "epoch": str(e), "train_loss": "1.0", "val_loss": "1.5",
         "val_accuracy": "0.5", "lr": repr(schedule(5 * e - 1))} for e in (1, 2)
    ]  # fmt: skip
    run_log.plot_curves(epoch_rows, schedule)  # no step rows (--log-every 0)
    loss, _, lr = figures[-1].axes
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["train (epoch)", "val"]
    assert list(lr.lines[0].get_xdata()) == list(range(1, 11))
    assert list(lr.lines[0].get_ydata()) == [schedule(s) for s in range(10)]  # warmup from 0.1 to 0.2, then decay
    step_rows = [{"kind": "step", "global_step": str(s), "epoch": "1", "train_loss": "2.0"} for s in (2, 4)]
    run_log.plot_curves(step_rows + epoch_rows, schedule)
    assert [t.get_text() for t in figures[-1].axes[0].get_legend().get_texts()] == [
        "train (running mean of the epoch)", "train (epoch)", "val"
    ]  # fmt: skip
    run_log.plot_curves([dict(row, global_step=str(10_000 * e)) for e, row in enumerate(epoch_rows, 1)], schedule)
    assert len(figures[-1].axes[2].lines[0].get_xdata()) == run_log.LR_POINTS  # a long run: a sample of its steps


@pytest.mark.parametrize("steps_per_epoch, expected", [(1, 1), (5, 1), (11, 2), (22, 5), (100, 25), (1000, 50)])
def test_a_short_epoch_still_logs_a_few_step_rows(steps_per_epoch, expected):
    from raytrain_mp.progress import log_interval

    assert log_interval(None, steps_per_epoch) == expected
    assert log_interval(0, steps_per_epoch) == 0 and log_interval(7, steps_per_epoch) == 7  # as given
