"""Checkpoint folders a user can take out of the tool.

A checkpoint folder holds:

- ``model.pt``: the plain model's state dict (no ``module.`` prefix; SyncBatchNorm keys are
  BatchNorm's), loadable with ``load_state_dict(strict=True)`` into ``build_model(...)``.
- ``train_state.pt``: everything else needed to continue exactly: optimizer, lr scheduler,
  grad scaler, epoch and step counters, RNG states.
- ``config.yaml``: the command's configuration, for humans and for ``--config``.
- ``ema.pt`` (runs with ``--model-ema``): the weight average's state dict, plain as ``model.pt``
  (its count of averages is in ``train_state.pt``).

Beside a run's checkpoint folders, ``result.json`` holds the summary of the last time the run
finished, so a rerun of a finished run prints it without starting Ray.

Invariant: a folder is written completely into a fresh temporary directory before anyone (Ray's
persistence layer, a rename) publishes it, so a crash never leaves a half-written checkpoint;
``result.json`` is replaced atomically too. A checkpoint is published (``is_published``) when its
three files are there and: in a run Ray Train kept (ddp, a sweep's trial), it is listed in the run's
``checkpoint_manager_snapshot.json`` (Ray records a checkpoint only after its upload, which is no
rename, also locally); in a pipeline run, it is local (renamed into place) or has the ``.complete``
marker it is uploaded with last. Both loops publish here, each after publishing the run's log (so
it covers every step of the checkpoint): a ddp worker hands the folder to Ray Train
(``report_checkpoint``), the pipeline driver renames or uploads it (``publish_checkpoint``).

A run a signal stopped is told by its last published checkpoint (``interrupted_line``): the one a
rerun continues from.
"""

from __future__ import annotations

import io
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain_mp.interruption import Interrupted
from raytrain_mp.storage import (
    COMPLETE_MARKER,
    Location,
    delete_folder,
    download_folder,
    is_complete,
    make_ordinary,
    name_of,
    publish_folder,
)

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
CONFIG_FILE = "config.yaml"
EMA_FILE = "ema.pt"
RESULT_FILE = "result.json"
CHECKPOINT_PREFIX = "checkpoint_"
CHECKPOINT_FILES = (MODEL_FILE, CONFIG_FILE, STATE_FILE)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of a run's registered checkpoints


def checkpoint_name(epoch: int, step: int = 0) -> str:
    """A run's checkpoint folder name: ``checkpoint_000002`` at the end of epoch 2 (from 1), and
    ``checkpoint_000002_step_000010`` after step 10 of epoch 2 (``--checkpoint-every-steps``)."""
    return f"{CHECKPOINT_PREFIX}{epoch:06d}" + (f"_step_{step:06d}" if step else "")


def checkpoint_order(name: str) -> tuple[int, float]:
    """Sort key of ``checkpoint_name``s in the order they were written: a mid-epoch checkpoint of
    epoch E before the one at its end (by name, ``checkpoint_000002`` sorts before
    ``checkpoint_000002_step_000010``)."""
    epoch, _, step = name.removeprefix(CHECKPOINT_PREFIX).partition("_step_")
    return int(epoch), int(step) if step else float("inf")


def resume_position(last_epoch: int, steps_done: int, steps_per_epoch: int) -> tuple[int, int]:
    """``(epoch, step)`` to resume at, from a checkpoint written after ``steps_done`` steps of the
    epoch after ``last_epoch`` (-1: none finished). A position past the end of the epoch (the data
    set shrank since) starts the next epoch."""
    epoch, step = last_epoch + 1, steps_done
    if step >= steps_per_epoch:
        return epoch + 1, 0
    return epoch, step


def resumed_at(train_state: dict, steps_per_epoch: int, no_loss: Any) -> tuple[tuple[int, int], Any]:
    """(``resume_position`` of a checkpoint's ``train_state``, the loss of the epoch's steps before
    it): what ``checkpoint_state`` saved within an epoch, ``no_loss`` at an epoch's start."""
    position = resume_position(train_state["epoch"], train_state.get("step", 0), steps_per_epoch)
    return position, train_state.get("epoch_loss", no_loss) if position[1] else no_loss


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the model inside DDP (or any ``.module`` wrapper), on the CPU."""
    inner = getattr(model, "module", model)
    return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}


def rng_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])


def write_checkpoint(
    model_state: dict, train_state: dict, config_yaml: str, ema_state: dict | None = None, parent: str | None = None
) -> Path:
    """Write a complete checkpoint into a new temporary folder and return it (``ema_state``: the
    weight average's, when the run keeps one)."""
    folder = Path(tempfile.mkdtemp(prefix="raytrain-ckpt-", dir=parent))
    torch.save(model_state, folder / MODEL_FILE)
    if ema_state is not None:
        torch.save(ema_state, folder / EMA_FILE)
    torch.save(train_state, folder / STATE_FILE)
    (folder / CONFIG_FILE).write_text(config_yaml)
    make_ordinary(folder)  # readable as the user's files are, wherever Ray Train or we move it
    return folder


def checkpoint_state(epoch: int, step: int, epoch_loss: Any, **state: Any) -> dict[str, Any]:
    """``train_state.pt`` of a checkpoint after ``step`` steps of epoch ``epoch`` (from 0), or after
    the whole epoch when ``step`` is 0: what the loop resumes (``state``: optimizer states and the
    like), the position as ``resume_position`` reads it (``epoch``: the last finished one), the
    epoch's loss so far and the RNG states."""
    position = {"epoch": epoch - 1 if step else epoch, "step": step, "epoch_loss": epoch_loss}
    return {**state, **position, "rng": rng_states()}


def report_checkpoint(metrics: dict, name: str, checkpoint: tuple | None, log: Any) -> None:
    """Ray Train's way to publish (a ddp worker): every rank reports ``metrics``; the one holding
    ``checkpoint`` (``write_checkpoint``'s arguments) publishes its run ``log`` first, so that the
    log covers every step of the checkpoint, and attaches it, to be uploaded as ``name``."""
    import ray.train  # Ray Train only in a worker that reports to it

    folder = None
    if checkpoint is not None:
        log.publish()
        folder = ray.train.Checkpoint.from_directory(write_checkpoint(*checkpoint))
    ray.train.report(metrics, checkpoint=folder, checkpoint_dir_name=name, delete_local_checkpoint_after_upload=True)


def wait_until_reports_taken() -> None:
    """Blocks a ddp worker until Ray Train's controller has polled every report it made. Ray Train
    registers a checkpoint only from a poll that finds every rank's report, and drops the reports
    still queued on a worker when a poll finds a failure first: a worker about to fail on purpose
    (``--inject-fault``) waits here so that its last checkpoint is the one a restart resumes from.
    Ray Train has no public call for it; its report queue is a ``queue.Queue`` whose poll marks
    each report done."""
    from ray.train.v2._internal.execution.context import get_train_context

    get_train_context().get_result_queue().join()


def local_parent(run: Location) -> str | None:
    """Where a checkpoint is written before publishing: inside a local run folder (so publishing
    is a rename on one filesystem), else the system's temporary folder."""
    if not run.is_local:
        return None
    Path(run.path).mkdir(parents=True, exist_ok=True)
    return run.path


def publish_checkpoint(
    run: Location, name: str, checkpoint: tuple[dict, dict, str], log: Any, num_to_keep: int
) -> Location:
    """The pipeline driver's way to publish: its run ``log`` first (see ``report_checkpoint``), then
    ``checkpoint`` (``write_checkpoint``'s arguments) written locally and published into ``run`` as
    ``name`` (``storage.publish_folder``: never half there); drops the oldest beyond ``num_to_keep``."""
    log.publish()
    target = run.child(name)
    publish_folder(write_checkpoint(*checkpoint, parent=local_parent(run)), target)
    for old in [f for f in run.folders(CHECKPOINT_PREFIX, checkpoint_order) if is_complete(f)][:-num_to_keep]:
        delete_folder(old)
    return target


def read_checkpoint(folder: str | Path) -> tuple[dict, dict]:
    """``(model_state, train_state)`` of a checkpoint folder."""
    folder = Path(folder)
    model_state = torch.load(folder / MODEL_FILE, map_location="cpu", weights_only=True)
    train_state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    return model_state, train_state


def read_ema(folder: str | Path) -> dict | None:
    """The weight average's state dict of a local checkpoint folder (None: the run kept none)."""
    file = Path(folder) / EMA_FILE
    return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else None


def load_ema(folder: Location) -> dict | None:
    """``read_ema`` of a checkpoint folder anywhere (only ``ema.pt`` is read)."""
    file = folder.child(EMA_FILE)
    return torch.load(io.BytesIO(file.read_bytes()), map_location="cpu", weights_only=True) if file.is_file() else None


def write_result(run: Location, result: dict[str, Any]) -> None:
    """Save a finished run's summary next to its checkpoints (one atomic write, any storage)."""
    run.child(RESULT_FILE).write_bytes(json.dumps(result, default=str).encode())


def finished_result(run: Location, epochs: int) -> dict[str, Any] | None:
    """The saved summary of the run at ``run`` when it has finished ``epochs`` or more epochs."""
    file = run.child(RESULT_FILE)
    if not file.is_file():
        return None
    result = json.loads(file.read_bytes())
    return result if (result.get("epochs") or 0) >= epochs else None


def load_train_state(folder: Location) -> dict:
    """Only ``train_state.pt`` of a checkpoint folder anywhere (no model download)."""
    return torch.load(io.BytesIO(folder.child(STATE_FILE).read_bytes()), map_location="cpu", weights_only=False)


def load_checkpoint(folder: Location) -> tuple[dict, dict]:
    """``read_checkpoint`` of a checkpoint folder anywhere (an object store's is downloaded first)."""
    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as tmp:
        return read_checkpoint(download_folder(folder, Path(tmp) / "checkpoint"))


def missing_files(folder: Location) -> list[str]:
    """The checkpoint files ``folder`` lacks."""
    return [name for name in CHECKPOINT_FILES if not folder.child(name).is_file()]


def ray_registered(run: Location) -> set[str] | None:
    """Names of the checkpoints Ray Train registered in ``run``; None when it kept no record there."""
    snapshot = run.child(RAY_SNAPSHOT)
    if not snapshot.is_file():
        return None
    try:
        data = json.loads(snapshot.read_bytes())
        return {r["checkpoint_dir_name"] for r in data.get("checkpoint_results", [])}
    except (ValueError, KeyError, TypeError):
        return set()


def is_published(folder: Location, registered: set[str] | None) -> bool:
    """A complete checkpoint folder (see the module docstring); ``registered``: ``ray_registered`` of its run."""
    if missing_files(folder):
        return False
    if registered is not None:
        return folder.path.rstrip("/").rsplit("/", 1)[-1] in registered
    return folder.is_local or folder.child(COMPLETE_MARKER).is_file()


def published_checkpoints(run: Location) -> tuple[list[Location], list[Location]]:
    """(every ``checkpoint_*`` folder of ``run``, the published ones), oldest first (``checkpoint_order``)."""
    candidates = run.folders(CHECKPOINT_PREFIX, checkpoint_order)
    registered = ray_registered(run)
    return candidates, [folder for folder in candidates if is_published(folder, registered)]


def interrupted_line(exc: Interrupted) -> str:
    """``interrupted at epoch E step S; the last checkpoint is URI; rerun the same command with
    --name NAME to continue`` (the name: a made-up one is in no command the user typed)."""
    where = f" at epoch {exc.at[0]} step {exc.at[1]}" if exc.at else ""
    if exc.run is None:
        return f"interrupted{where}"
    published = published_checkpoints(exc.run)[1] if exc.run.exists() else []
    last = f"the last checkpoint is {published[-1].uri}" if published else "no checkpoint was written yet"
    again = "continue" if published else "start over"
    return f"interrupted{where}; {last}; rerun the same command with --name {name_of(exc.run.uri)} to {again}"
