"""What the DDP loop and the pipeline loop decide around their epochs, without Ray: ``epochs``
(the run's model and dtype, checkpoint due, epoch line), ``lr_schedule.schedule_for``,
``fault_injection.FaultSpec``, and the checkpoint state and publishing both loops share (``checkpointing``).

The loops' own walks over an epoch are replayed here step by step (the DDP loop asks after each
step, the pipeline cuts the epoch into segments): both must write the same checkpoints.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from raytrain_mp.checkpointing import (
    checkpoint_name,
    checkpoint_order,
    checkpoint_state,
    publish_checkpoint,
    read_checkpoint,
    resumed_at,
)
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.epochs import build_run_model, checkpoint_due, due_by_steps, epoch_line, run_dtype
from raytrain_mp.errors import UsageError
from raytrain_mp.fault_injection import FaultSpec
from raytrain_mp.lr_schedule import make_schedule, schedule_for
from raytrain_mp.models import build_model
from raytrain_mp.pipeline.config import PipelineConfig
from raytrain_mp.pipeline.run import step_segments
from raytrain_mp.storage import locate


def config(epochs: int, every: int, every_steps: int | None) -> SimpleNamespace:
    return SimpleNamespace(epochs=epochs, checkpoint_every=every, checkpoint_every_steps=every_steps)


GRID = list(
    itertools.product(range(1, 5), range(1, 6), range(1, 4), [None, 0, 1, 2, 3, 4, 7])
)  # epochs, steps/epoch, every, every_steps


def ddp_checkpoints(cfg, steps_per_epoch: int, start: tuple[int, int] = (0, 0)) -> list[str]:
    """The checkpoints ``ddp.loop`` writes: it asks after every step, and at the epoch's end."""
    names = []
    for epoch in range(start[0], cfg.epochs):
        first = start[1] if epoch == start[0] else 0
        names += [
            checkpoint_name(epoch + 1, step + 1)
            for step in range(first, steps_per_epoch)
            if step + 1 < steps_per_epoch and checkpoint_due(cfg, epoch, step + 1, steps_per_epoch)
        ]
        names += [checkpoint_name(epoch + 1)] if checkpoint_due(cfg, epoch, steps_per_epoch, steps_per_epoch) else []
    return names


def pipeline_checkpoints(cfg, steps_per_epoch: int, start: tuple[int, int] = (0, 0)) -> list[str]:
    """The checkpoints ``pipeline.run.train_epochs`` writes: after each segment but the last, and at the epoch's end."""
    names = []
    for epoch in range(start[0], cfg.epochs):
        first = start[1] if epoch == start[0] else 0
        segments = step_segments(first, steps_per_epoch, epoch, cfg.checkpoint_every_steps)
        names += [checkpoint_name(epoch + 1, segment.stop) for segment in segments if segment.stop < steps_per_epoch]
        names += [checkpoint_name(epoch + 1)] if checkpoint_due(cfg, epoch, steps_per_epoch, steps_per_epoch) else []
    return names


def test_run_dtype_is_float64_only_for_fp64():
    assert run_dtype("fp64") == torch.float64
    for precision in ("fp32", "bf16", "fp16"):
        assert run_dtype(precision) == torch.float32


@pytest.mark.parametrize("every_steps", [None, 0])
def test_no_checkpoint_by_steps_when_off(every_steps):
    assert not any(due_by_steps(step, every_steps) for step in range(50))


def test_due_by_steps_after_every_multiple():
    for every, step in itertools.product(range(1, 8), range(1, 50)):
        assert due_by_steps(step, every) == (step % every == 0)


def test_checkpoint_due_everywhere_it_should_be_and_nowhere_else():
    for epochs, steps_per_epoch, every, every_steps in GRID:
        cfg = config(epochs, every, every_steps)
        for epoch, steps_done in itertools.product(range(epochs), range(1, steps_per_epoch + 1)):
            global_step = epoch * steps_per_epoch + steps_done
            by_steps = bool(every_steps) and global_step % every_steps == 0
            at_end = steps_done == steps_per_epoch
            by_epochs = at_end and ((epoch + 1) % every == 0 or epoch + 1 == epochs)
            due = checkpoint_due(cfg, epoch, steps_done, steps_per_epoch)
            assert due == (by_steps or by_epochs), (cfg, steps_per_epoch, epoch, steps_done)
        assert checkpoint_due(cfg, epochs - 1, steps_per_epoch, steps_per_epoch)  # the last epoch's end, always


def test_both_loops_write_the_same_checkpoints_also_from_a_resumed_position():
    for epochs, steps_per_epoch, every, every_steps in GRID:
        cfg = config(epochs, every, every_steps)
        whole = ddp_checkpoints(cfg, steps_per_epoch)
        for start in itertools.product(range(epochs), range(steps_per_epoch)):
            ddp = ddp_checkpoints(cfg, steps_per_epoch, start)
            assert ddp == pipeline_checkpoints(cfg, steps_per_epoch, start), (cfg, steps_per_epoch, start)
            # A resumed run writes what the uninterrupted one writes after its position.
            assert ddp == whole[len(whole) - len(ddp) :], (cfg, steps_per_epoch, start)


def test_checkpoints_of_a_run_by_steps_and_epochs():
    cfg = config(epochs=3, every=2, every_steps=4)
    assert ddp_checkpoints(cfg, 3) == [
        "checkpoint_000002_step_000001",  # global step 4
        "checkpoint_000002",
        "checkpoint_000003_step_000002",  # global step 8
        "checkpoint_000003",  # the last epoch
    ]


METRICS = {
    "epoch": 2,
    "train_loss": 1.234567,
    "val_loss": 0.5,
    "val_accuracy": 0.87654,
    "samples_per_second": 1234.56,
    "lr": 0.0123456,
}


def test_epoch_line_of_ddp():
    assert (
        epoch_line(METRICS, 6)
        == "epoch 2/6 train_loss 1.235 val_loss 0.5 val_accuracy 0.8765 samples/s 1234.6 lr 0.01235"
    )


def test_epoch_line_takes_the_pipeline_bubble_before_the_lr():
    line = epoch_line(METRICS, 6, " bubble 0.250 (stage times 0.100/0.200 s/step)")
    assert line == (
        "epoch 2/6 train_loss 1.235 val_loss 0.5 val_accuracy 0.8765 samples/s 1234.6 "
        "bubble 0.250 (stage times 0.100/0.200 s/step) lr 0.01235"
    )


@pytest.mark.parametrize("cls", [DDPConfig, PipelineConfig])
@pytest.mark.parametrize(
    "changes",
    [{}, {"base_lr": 0.4, "global_batch_size": 512, "lr_rule": "sqrt", "warmup_epochs": 0.5},
     {"lr_decay": "step", "step_epochs": 2, "gamma": 0.5, "epochs": 7, "base_batch": 32}],
)  # fmt: skip
def test_schedule_for_a_config_is_make_schedule_of_its_options(cls, changes):
    cfg = cls(**changes)
    for steps_per_epoch in (1, 3, 10):
        expected = make_schedule(
            cfg.base_lr,
            cfg.global_batch_size,
            cfg.base_batch,
            cfg.lr_rule,
            cfg.warmup_epochs,
            cfg.epochs,
            steps_per_epoch,
            cfg.lr_decay,
            cfg.step_epochs,
            cfg.gamma,
        )
        assert schedule_for(cfg, steps_per_epoch) == expected


@pytest.mark.parametrize(
    "spec, expected",
    [("0:3:/tmp/m", FaultSpec(0, "3", "/tmp/m")), ("12:s40:/a:b", FaultSpec(12, "s40", "/a:b")), (None, None)],
)
def test_fault_spec_parses(spec, expected):
    assert FaultSpec.parse(spec) == expected


@pytest.mark.parametrize("spec", ["0:3", "x:3:m", "0:e3:m", "0:s:m", "0:sx:m", "-1:3:m", "0::m", ""])
def test_a_malformed_fault_spec_is_one_usage_line(spec):
    with pytest.raises(UsageError, match="^--inject-fault: accepted: INDEX:EPOCH:MARKER or INDEX:sSTEP:MARKER$"):
        FaultSpec.parse(spec)


def test_a_fault_after_a_step_only_where_the_loop_can_fail_there():
    assert FaultSpec.parse("1:2:m", at_steps=False) == FaultSpec(1, "2", "m")
    with pytest.raises(UsageError, match="^--inject-fault: accepted: INDEX:EPOCH:MARKER$"):
        FaultSpec.parse("1:s2:m", at_steps=False)


@pytest.mark.parametrize("when, at, point", [("3", "3", "after epoch 3"), ("s12", "s12", "after step 12")])
def test_a_fault_fires_once_at_its_point(tmp_path, when, at, point):
    fault = FaultSpec(1, when, str(tmp_path / "marker"))
    assert not fault.due("s3" if when == "3" else "12") and not fault.due("4")
    assert fault.due(at)
    assert fault.mark("rank 1 crashed") == point
    assert (tmp_path / "marker").read_text() == f"rank 1 crashed {point}\n"
    assert not fault.due(at)  # the marker says it did


def test_checkpoint_state_resumes_at_the_next_step():
    steps_per_epoch = 4
    for epoch, step in itertools.product(range(3), range(steps_per_epoch)):
        state = checkpoint_state(epoch, step, (1.5, 8.0), optimizer={"lr": 0.1})
        assert state["optimizer"] == {"lr": 0.1} and set(state["rng"]) == {"torch", "numpy", "python"}
        position, carried = resumed_at(state, steps_per_epoch, (0.0, 0.0))
        # After a whole epoch (step 0) the next starts; within one, the epoch's loss so far carries over.
        assert (position, carried) == (((epoch + 1, 0), (0.0, 0.0)) if step == 0 else ((epoch, step), (1.5, 8.0)))


def test_resumed_at_a_position_past_a_shrunk_epoch_starts_the_next():
    state = checkpoint_state(2, 5, 3.0)
    assert resumed_at(state, 4, 0.0) == ((3, 0), 0.0)
    assert resumed_at({"epoch": 1}, 4, 0.0) == ((2, 0), 0.0)  # a checkpoint from before steps were saved


class Log:
    def __init__(self, run) -> None:
        self.run, self.published = run, []

    def publish(self) -> None:
        self.published.append([f.path.rsplit("/", 1)[-1] for f in self.run.folders("checkpoint_", checkpoint_order)])


def test_publish_checkpoint_publishes_the_log_first_and_keeps_the_newest(tmp_path):
    run = locate(str(tmp_path / "run"), "--storage-path")
    log = Log(run)
    names = [checkpoint_name(1, 2), checkpoint_name(1), checkpoint_name(2, 2)]
    for i, name in enumerate(names):
        target = publish_checkpoint(
            run, name, ({"w": torch.tensor([float(i)])}, {"step": i}, "epochs: 2\n"), log, num_to_keep=2
        )
        assert target.uri == run.child(name).uri
    assert log.published == [[], [names[0]], names[:2]]  # each time before the new checkpoint is there
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(names[1:])  # nothing else: no temporary left
    model_state, train_state = read_checkpoint(tmp_path / "run" / names[2])
    assert model_state["w"].item() == 2.0 and train_state == {"step": 2}
    assert (tmp_path / "run" / names[2] / "config.yaml").read_text() == "epochs: 2\n"


@pytest.mark.parametrize(
    "precision, dtype", [("fp64", torch.float64), ("fp32", torch.float32), ("bf16", torch.float32)]
)
def test_the_run_model_is_the_seeded_model_in_the_run_dtype(precision, dtype):
    cfg, meta = (
        DDPConfig(model="resnet18", precision=precision),
        SimpleNamespace(num_classes=10, channels=1, image_size=8, image_shape=(8, 8, 1), encoded=False),
    )
    torch.manual_seed(0)
    model = build_run_model(cfg, meta)
    torch.manual_seed(0)
    plain = build_model("resnet18", 10, 1, None, None, image_size=8)
    assert {p.dtype for p in model.state_dict().values() if p.is_floating_point()} == {dtype}
    assert all(
        torch.equal(a.to(torch.float64), b.to(dtype).to(torch.float64))
        for a, b in zip(model.state_dict().values(), plain.state_dict().values())
    )
