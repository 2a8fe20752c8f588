"""Reading a run folder's log (``run_log``) back in tests: the CSV's rows, and the TensorBoard
events read as TensorBoard does without the ``tensorboard`` package: the TFRecord framing (length,
its CRC, the record, its CRC), files in name order, and a ``SessionLog.START`` at step S dropping
what earlier files hold at S and later (``purge_step``)."""

from __future__ import annotations

import struct

import pyarrow.fs as pafs
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog

from raytrain_mp.run_log import CURVES_FILE, TAGS, read_rows
from raytrain_mp.storage import Location, locate


def read_events(run: Location) -> dict[tuple[str, int], float]:
    """``{(tag, step): value}`` of the run folder's event files, as TensorBoard shows them."""
    infos = run.fs.get_file_info(pafs.FileSelector(run.path))
    names = sorted(info.base_name for info in infos if info.base_name.startswith("events.out.tfevents."))
    assert names, "no event file"
    scalars: dict[tuple[str, int], float] = {}
    for name in names:
        data = run.child(name).read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                scalars = {key: value for key, value in scalars.items() if key[1] < event.step}
            for value in event.summary.value:
                assert (value.tag, event.step) not in scalars, ("twice", value.tag, event.step)
                scalars[(value.tag, event.step)] = value.simple_value
    return scalars


def csv_as_events(rows: list[dict[str, str]]) -> dict[tuple[str, int], float]:
    """The events the CSV's rows stand for."""
    return {
        (TAGS[r["kind"]][name], int(r["global_step"])): float(r[name])
        for r in rows
        for name in TAGS[r["kind"]]
        if r.get(name)
    }


def checked_run_log(
    run: str, steps: int, epochs: int, steps_per_epoch: int, log_every: int = 1
) -> list[dict[str, str]]:
    """The rows of the finished run at ``run`` (a path or URI), after checking that it logged every
    ``log_every``-th of ``steps`` global steps and every epoch exactly once, in order, that its
    events carry the CSV's numbers and that it drew its curves."""
    folder = locate(run, "run")
    rows = read_rows(folder)
    logged = [int(r["global_step"]) for r in rows if r["kind"] == "step"] if log_every else []
    assert logged == [s for s in range(1, steps + 1) if log_every and ((s - 1) % steps_per_epoch + 1) % log_every == 0]
    assert [(int(r["epoch"]), int(r["global_step"])) for r in rows if r["kind"] == "epoch"] == [
        (e, e * steps_per_epoch) for e in range(1, epochs + 1)
    ]
    assert read_events(folder) == pytest.approx(csv_as_events(rows), rel=1e-6)  # TensorBoard holds float32
    assert folder.child(CURVES_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows
