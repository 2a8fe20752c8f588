"""The DDP trainer as a Ray Tune function trainable: what a ``raytrain-mp tune`` trial runs, for a
user's own ``tune.Tuner`` (their search space, searcher and scheduler, PBT included).

Job: a trial's ``params`` (keys: ``DDPConfig`` field names, e.g. ``base_lr``, ``weight_decay``,
``label_smoothing``) become the trial's ``DDPConfig``, whose ``TorchTrainer`` (``ddp.trainer``) is
fitted on a thread of the trial while the trial hands every epoch's rank-0 metrics (``epoch``,
``val_accuracy``, ``val_loss``, ``train_loss``, ``lr``, ..., and ``run``, the Train run's folder
name) and its checkpoint to ``tune.report``. Ray Train's own ``TuneReportCallback`` passes metrics
only, and a scheduler that exploits checkpoints (PBT) needs Tune to hold them.

Invariants:
- ``tune_trainable`` checks the template on the driver as ``raytrain-mp ddp`` checks its options
  (data set, model, the cluster's fit) before any trial; a trial's point is validated as the
  command validates it, so a bad point fails that trial with the option's one line.
- A trial's Train runs are ``<storage>/train-<trial id>`` and, after each PBT exploit,
  ``train-<trial id>-<n>`` started from a copy of the exploited checkpoint (``start_of``) under the
  trial's perturbed options (``optim.load_under_own_options``). A trial that Tune restores
  (``Tuner.restore``, a PBT pause) continues its newest run from that run's newest checkpoint,
  with the ``ddp`` command's exact resume; a finished trial's run is never trained again.
- Tune keeps a copy of each reported checkpoint in the trial's folder (its ``CheckpointConfig``
  bounds how many); ``result.checkpoint`` is a plain checkpoint of ours, loadable as the run's.
- The trial's own function mostly waits for its workers; it holds ``TRIAL_DRIVER_CPUS``. Ray Train
  places the workers outside the trial's resources, so Tune cannot count them: the caller caps
  ``max_concurrent_trials`` at what fits (``tune.config.trials_that_fit``; ray issue 54305), and
  a trial Tune stops (a scheduler's decision, PBT's pause, or the last epoch's report reaching
  ``max_t``) leaves its workers' placement group behind unless the experiment runs
  ``ReleaseStoppedWorkerGroups``.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.core.generated import gcs_pb2
from ray.train import UserCallback
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.queue import Queue

from raytrain_mp.config import absolute_path
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.ddp.trainer import build_trainer, with_checked_data, with_cluster_settings
from raytrain_mp.storage import locate, publish_folder
from raytrain_mp.tracking import tracked
from raytrain_mp.tune.config import TRIAL_DRIVER_CPUS

# Where and under which name a trial's run is written: the trainable's to choose, not a point's.
NOT_PER_POINT = ("name", "storage_path", "resume_from", "json")


def run_name(trial_id: str) -> str:
    """The folder of a trial's Train run in the experiment."""
    return f"train-{trial_id}"


def trial_function(template: DDPConfig, experiment: str) -> Any:
    """The trainable of an already prepared ``template`` (data resolved, GPU use decided), whose
    trials write their runs into ``experiment``; Tune's ``with_resources`` and ``with_parameters``
    applied (the template travels through the object store once)."""
    return tune.with_resources(
        tune.with_parameters(run_trial, template=template, experiment=experiment), {"cpu": TRIAL_DRIVER_CPUS}
    )


def run_trial(params: dict[str, Any], template: DDPConfig, experiment: str) -> None:
    """Fit the trial's DDP run, reporting every epoch's metrics and checkpoint to Tune.

    The run is fitted on a thread of the trial while the trial's own thread hands its reports to
    Tune: ``tune.report`` with a checkpoint must come from the trial's function, and Ray Train's
    ``TuneReportCallback`` passes metrics only (a scheduler that exploits checkpoints, PBT, needs them)."""
    fields = {f.name for f in dataclasses.fields(DDPConfig)} - set(NOT_PER_POINT)
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(
            f"param_space: {', '.join(unknown)} not DDPConfig options; accepted: {', '.join(sorted(fields))}"
        )
    cfg = dataclasses.replace(template, **params, storage_path=experiment)
    cfg = dataclasses.replace(cfg, **start_of(tune.get_checkpoint(), tune.get_context(), experiment))
    cfg.validate()
    # --mlflow: a child of the sweep's MLflow run a Train run (a PBT exploit starts a new one)
    tags = {"raytrain_mp.trial": tune.get_context().get_trial_id()}
    if cfg.resume_from is not None:  # a PBT exploit: another trial's checkpoint
        tags["raytrain_mp.resumed_from"] = cfg.resume_from
    with tracked(cfg, locate(experiment, "storage_path").child(cfg.name), "tune trial", True, tags=tags) as mlflow:
        last = fit_reporting(mlflow.config)
        mlflow.checkpoint = last[1].path if last and last[1] else None
    # Only now: Tune may end the trial as soon as it has the last epoch (its scheduler's max_t).
    if last is not None:
        tune_report(cfg, *last)


def fit_reporting(cfg: DDPConfig) -> tuple[dict, Any] | None:
    """Fit ``cfg``'s run on a thread, handing each report to ``tune.report`` from this thread but
    the last epoch's, which it returns (metrics, checkpoint) once the run has ended."""
    reports: Queue = Queue(1, actor_options={"num_cpus": 0})  # 1: the run waits until Tune has each report
    failure: list[BaseException] = []
    last = None

    def fit() -> None:
        try:
            build_trainer(cfg, callbacks=[ReportToTrial(reports)]).fit()
        except BaseException as exc:  # raised again on the trial's thread, where Tune records it
            failure.append(exc)
        finally:
            reports.put(None)

    thread = threading.Thread(target=fit, name=f"fit {cfg.name}", daemon=True)
    thread.start()
    while (report := reports.get()) is not None:
        if report[0].get("epoch") == cfg.epochs:
            last = report
        else:
            tune_report(cfg, *report)
    thread.join()
    if failure:
        raise failure[0]
    return last


def tune_report(cfg: DDPConfig, metrics: dict, checkpoint: Any) -> None:
    """A report of the run to Tune; Tune keeps a copy of its checkpoint in the trial's folder
    (PBT's exploit and Tune's restore start from it)."""
    metrics = {**metrics, "run": cfg.name}
    if checkpoint is None:
        tune.report(metrics)
    else:
        tune.report(metrics, checkpoint=tune.Checkpoint(checkpoint.path, checkpoint.filesystem))


class ReportToTrial(UserCallback):
    """In the Train run's controller: each report's rank-0 metrics and checkpoint, to the trial's thread."""

    def __init__(self, reports: Queue) -> None:
        self.reports = reports

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        self.reports.put((metrics[0], checkpoint))


def start_of(checkpoint: tune.Checkpoint | None, context: Any, experiment: str) -> dict[str, Any]:
    """The Train run a trial fits (``name``) and, for a new run from another trial's checkpoint,
    where it starts (``resume_from``).

    Without a Tune checkpoint, or with one of the trial's own (Tune restoring an interrupted or
    paused trial), the trial's newest run continues from its own newest checkpoint, as a rerun of
    the ``ddp`` command does. With another trial's checkpoint (PBT's exploit) the trial starts a
    new run from a copy of it, ``train-<trial id>-<n>``, under the trial's (perturbed) options."""
    own = run_name(context.get_trial_id())
    root = locate(experiment, "storage_path")
    folders = root.folders(own, order=_generation)
    runs = [name for name in (Path(f.path).name for f in folders) if name == own or name.startswith(f"{own}-")]
    newest = runs[-1] if runs else own
    if checkpoint is None or Path(checkpoint.path).parent.name == Path(context.get_trial_dir()).name:
        return {"name": newest}
    fork = f"{own}-{_generation(newest) + 1}"
    start = root.child(f"{fork}-start")
    with checkpoint.as_directory() as exploited, tempfile.TemporaryDirectory() as scratch:
        copy = shutil.copytree(exploited, Path(scratch) / "start")
        publish_folder(copy, start)
    return {"name": fork, "resume_from": start.uri}


def _generation(name: str) -> int:
    """1 for a trial's first run ``train-<id>``, n for its n-th ``train-<id>-<n>``; -1 for a fork's start copy."""
    if name.endswith("-start"):
        return -1
    last = name.rsplit("-", 1)[-1]
    return int(last) if last.isdigit() else 1


def tune_trainable(config: DDPConfig, storage_path: str | None = None) -> Any:
    """A Tune trainable of ``config``: pass it to ``tune.Tuner`` with a ``param_space`` keyed by
    ``DDPConfig`` field names. Checks ``config`` now, on the connected Ray cluster (call
    ``ray.init`` first); each trial's run goes to ``storage_path`` (default: ``config.storage_path``)."""
    config.validate()
    template = dataclasses.replace(with_cluster_settings(with_checked_data(config)), name=None)
    return trial_function(template, absolute_path(storage_path or template.storage_path))


class ReleaseStoppedWorkerGroups(tune.Callback):
    """Remove the workers' placement group of each Train run whose controller died with its trial.

    Tune stops a trial by ending its actor, and the Train controller that actor owns dies with it.
    The workers' placement group lives as long as the job, so without this it would hold its CPUs
    and GPUs for the rest of the sweep and later trials would wait forever for workers. Ray Train's
    own cleaner asks the dashboard's state API, which a Ray started without the dashboard lacks and
    which cannot tell several Ray instances on one machine apart; the GCS table can. Removed: the
    non-detached groups of this job whose creating actor is dead (Tune's own trial groups are made
    by the driver, not by an actor, and stay)."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self._last = 0.0

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            release_orphaned_placement_groups()


def release_orphaned_placement_groups() -> int:
    """Remove this job's non-detached placement groups whose creating actor is dead; return how many."""
    job = ray.get_runtime_context().get_job_id()
    nil_actor = ray.ActorID.nil().binary()
    released = 0
    # The public placement_group_table() drops the creator fields; the GCS accessor behind it has them.
    for blob in ray._private.state.state._connect_and_get_accessor().get_placement_group_table():
        group = gcs_pb2.PlacementGroupTableData.FromString(blob)
        if (
            group.creator_job_id.hex() == job
            and group.creator_actor_id != nil_actor
            and group.creator_actor_dead
            and not group.is_detached
            and group.state != gcs_pb2.PlacementGroupTableData.REMOVED
        ):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(group.placement_group_id)))
            released += 1
    return released
