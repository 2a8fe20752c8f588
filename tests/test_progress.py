"""The progress line's ETA on a fake clock, what a terminal and a pipe receive, and the line an
interrupt prints (pure: no Ray)."""

from __future__ import annotations

import io
import os
import signal

import pytest

from raytrain_mp.checkpointing import CHECKPOINT_FILES, RAY_SNAPSHOT, interrupted_line
from raytrain_mp.interruption import Interrupted, carried_signal, signals_interrupt, uninterrupted
from raytrain_mp.progress import ERASE_LINE, Console, Progress, duration
from raytrain_mp.storage import locate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_steps(progress: Progress, clock: Clock, steps: range, seconds: float) -> list[str | None]:
    dues = []
    for step in steps:
        clock.now += seconds
        dues.append(progress.step(step))
    return dues


def test_durations_read_as_a_clock():
    assert [duration(s) for s in (0, 12, 225, 3725, -3)] == ["0:00", "0:12", "3:45", "1:02:05", "0:00"]


def test_a_line_is_due_every_log_every_steps_and_live_at_most_every_half_second():
    clock = Clock()
    fast = Progress(2, 10, 32, 0, log_every=4, clock=clock)
    assert run_steps(fast, clock, range(1, 11), 0.1) == [None, None, None, "log", None, None, None, "log", None, None]
    clock = Clock()
    slow = Progress(2, 10, 32, 0, log_every=4, clock=clock)
    assert run_steps(slow, clock, range(1, 7), 0.3) == [None, "live", None, "log", None, "live"]
    clock = Clock()
    off = Progress(2, 10, 32, 0, log_every=0, clock=clock)
    assert run_steps(off, clock, range(1, 5), 0.3) == [None, "live", None, "live"]


def test_the_eta_of_the_epoch_and_of_the_run_include_evaluation_once_seen():
    clock = Clock()
    progress = Progress(2, 10, 32, 0, log_every=5, clock=clock)
    progress.start_epoch()
    run_steps(progress, clock, range(1, 6), 10.0)
    # 5 steps left in the epoch and 15 in the run, at 10 s each
    assert progress.line(1.23456) == "epoch 1/2 step 5/10 loss 1.235 samples/s 3.2 eta 0:50 (run 2:30)"
    assert progress.at == (1, 5)
    run_steps(progress, clock, range(6, 11), 10.0)
    assert progress.line(1.0).startswith("epoch 1/2 step 10/10 ") and progress.at == (1, 10)
    clock.now += 30.0  # evaluation and checkpoint
    progress.start_epoch()
    run_steps(progress, clock, range(11, 13), 10.0)
    # the epoch: 8 steps at 10 s; the run: 8 steps at 150 s / 12 steps
    assert progress.line(0.5) == "epoch 2/2 step 2/10 loss 0.5 samples/s 3.2 eta 1:20 (run 1:40)"


def test_a_resumed_attempt_times_only_its_own_steps():
    clock = Clock()
    progress = Progress(2, 10, 32, 13, log_every=1, clock=clock)  # resumed after step 3 of epoch 2
    assert progress.at == (2, 3)
    assert progress.line(2.0).endswith("eta ?")
    progress.start_epoch()
    assert run_steps(progress, clock, range(14, 15), 10.0) == ["log"]
    assert progress.line(2.0) == "epoch 2/2 step 4/10 loss 2.0 samples/s 3.2 eta 1:00 (run 1:00)"


def test_a_terminal_gets_one_line_rewritten_in_place_and_a_pipe_plain_lines():
    tty = io.StringIO()
    console = Console(stream=tty, live=True)
    console.progress("step 1", "live")
    console.progress("step 2", "log")
    console.say("epoch 1 done")
    console.progress("step 3", "live")
    console.end_line()
    assert (
        tty.getvalue() == f"\rstep 1{ERASE_LINE}\rstep 2{ERASE_LINE}\r{ERASE_LINE}epoch 1 done\n\rstep 3{ERASE_LINE}\n"
    )

    pipe = io.StringIO()
    console = Console(stream=pipe, live=False)
    console.progress("step 1", "live")
    console.progress("step 2", "log")
    console.say("epoch 1 done")
    console.end_line()
    assert pipe.getvalue() == "step 2\nepoch 1 done\n"

    quiet = io.StringIO()
    console = Console(quiet=True, stream=quiet, live=True)
    console.progress("step 2", "log")
    console.say("epoch 1 done")
    assert quiet.getvalue() == ""


def test_a_console_is_live_exactly_on_a_terminal():
    assert Console(stream=io.StringIO()).live is False
    read, write = os.openpty()
    with os.fdopen(write, "w") as terminal:
        assert Console(stream=terminal).live is True
    os.close(read)


def write_checkpoint_folder(folder) -> None:
    folder.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        (folder / name).write_bytes(b"x")


def test_the_interrupt_line_names_the_last_published_checkpoint_and_the_run(tmp_path):
    run = tmp_path / "runs" / "pipeline-20261203-120000"
    exc = Interrupted(signal.SIGINT)
    exc.at, exc.run = (1, 6), locate(str(run), "--storage-path")
    assert exc.exit_code == 130 and Interrupted(signal.SIGTERM).exit_code == 143
    assert interrupted_line(exc) == (
        "interrupted at epoch 1 step 6; no checkpoint was written yet; "
        "rerun the same command with --name pipeline-20261203-120000 to start over"
    )
    write_checkpoint_folder(run / "checkpoint_000001_step_000004")
    write_checkpoint_folder(run / "checkpoint_000001_step_000002")
    assert interrupted_line(exc) == (
        f"interrupted at epoch 1 step 6; the last checkpoint is {run}/checkpoint_000001_step_000004; "
        "rerun the same command with --name pipeline-20261203-120000 to continue"
    )
    # A Ray Train run: only what Ray registered counts (a folder may still be uploading).
    (run / RAY_SNAPSHOT).write_text(
        '{"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_000001_step_000002"}]}'
    )
    assert f"the last checkpoint is {run}/checkpoint_000001_step_000002;" in interrupted_line(exc)
    assert interrupted_line(Interrupted(signal.SIGINT)) == "interrupted"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_each_signal_raises_interrupted_within_the_block_only(signum):
    """SIGHUP (a closed terminal or SSH session) as SIGTERM: the run stops cleanly, exit 129."""
    before = signal.getsignal(signum)
    with pytest.raises(Interrupted) as raised:
        with signals_interrupt():
            os.kill(os.getpid(), signum)  # Python runs the handler at the next instruction
            pytest.fail("no Interrupted")
    assert raised.value.signum == signum and raised.value.exit_code == 128 + signum
    assert signal.getsignal(signum) is before


def test_an_interrupted_inside_a_ray_call_is_found_in_its_system_error():
    """Ray's ``CoreWorker.wait`` runs the handler and returns with the exception set: a SystemError
    caused by the Interrupted, which is what the command reports."""
    interrupted = Interrupted(signal.SIGTERM)
    try:
        try:
            raise interrupted
        except Interrupted as cause:
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from cause
    except SystemError as exc:
        assert carried_signal(exc) is interrupted
    assert carried_signal(interrupted) is interrupted
    assert carried_signal(SystemError("other")) is None and carried_signal(ValueError()) is None


def test_a_signal_inside_uninterrupted_waits_for_the_block_to_end():
    """A write under Ctrl-C ends whole: the signal raises once the block is done (an S3 stream
    closed by an exception between its open and its write would upload an empty object)."""
    done = []
    with pytest.raises(Interrupted) as raised:
        with signals_interrupt():
            with uninterrupted():
                with uninterrupted():  # nested: held until the outer block ends
                    os.kill(os.getpid(), signal.SIGINT)
                    done.append("inner")
                done.append("outer")
            pytest.fail("no Interrupted after the block")
    assert raised.value.signum == signal.SIGINT and done == ["inner", "outer"]
    with signals_interrupt(), uninterrupted():
        pass  # nothing held from before
    with pytest.raises(Interrupted), signals_interrupt():  # a block that fails still hands the signal on
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            raise OSError("the upload failed")
