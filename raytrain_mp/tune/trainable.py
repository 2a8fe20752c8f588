"""The DDP trainer as a Ray Tune function trainable: what a ``raytrain-mp tune`` trial runs, for a
user's own ``tune.Tuner`` (their search space, searcher and scheduler).

Job: a trial's ``params`` (keys: ``DDPConfig`` field names, e.g. ``base_lr``, ``weight_decay``,
``label_smoothing``) become the trial's ``DDPConfig``, whose ``TorchTrainer`` (``ddp.trainer``) is
fitted with Tune's ``TuneReportCallback``: every epoch's rank-0 metrics (``epoch``,
``val_accuracy``, ``val_loss``, ``train_loss``, ``lr``, ...) and its checkpoint reach Tune, as in a
``raytrain-mp tune`` trial.

Invariants:
- ``tune_trainable`` checks the template on the driver as ``raytrain-mp ddp`` checks its options
  (data set, model, the cluster's fit) before any trial; a trial's point is validated as the
  command validates it, so a bad point fails that trial with the option's one line.
- A trial's Train run is ``<storage>/train-<trial id>`` (``run_name``): a trial that Tune restores
  (``Tuner.restore``) continues from its run's newest checkpoint, with the ``ddp`` command's exact
  resume, and a finished trial's run is never trained again.
- The trial's own function mostly waits for its workers; it holds ``TRIAL_DRIVER_CPUS``. Ray Train
  places the workers outside the trial's resources, so Tune cannot count them: the caller caps
  ``max_concurrent_trials`` at what fits (``tune.config.trials_that_fit``; ray issue 54305).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from raytrain_mp.config import absolute_path
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.ddp.trainer import build_trainer, with_checked_data, with_cluster_settings
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
    """Fit the trial's DDP run, reporting every epoch to Tune."""
    fields = {f.name for f in dataclasses.fields(DDPConfig)} - set(NOT_PER_POINT)
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(
            f"param_space: {', '.join(unknown)} not DDPConfig options; accepted: {', '.join(sorted(fields))}"
        )
    trial_id = tune.get_context().get_trial_id()
    cfg = dataclasses.replace(template, **params, name=run_name(trial_id), storage_path=experiment)
    cfg.validate()
    build_trainer(cfg, callbacks=[TuneReportCallback()]).fit()


def tune_trainable(config: DDPConfig, storage_path: str | None = None) -> Any:
    """A Tune trainable of ``config``: pass it to ``tune.Tuner`` with a ``param_space`` keyed by
    ``DDPConfig`` field names. Checks ``config`` now, on the connected Ray cluster (call
    ``ray.init`` first); each trial's run goes to ``storage_path`` (default: ``config.storage_path``)."""
    config.validate()
    template = dataclasses.replace(with_cluster_settings(with_checked_data(config)), name=None)
    return trial_function(template, absolute_path(storage_path or template.storage_path))
