"""Run a learning-rate sweep on Ray Tune: each trial builds and fits one Ray Train ``TorchTrainer``.

The Ray Train V2 pattern (DESIGN.md): a trial is a function that turns its point of the search
space into a ``DDPConfig`` and fits ``build_trainer(cfg)`` with ``TuneReportCallback`` in the run's
callbacks, so every epoch's rank-0 metrics reach Tune (its scheduler and the results). Invariants:

- Before Ray starts, the data set is checked and the experiment folder is new (or, with
  ``--resume``, has the sweep's ``sweep.yaml``); before any trial starts, a trial's driver plus
  workers fit the cluster and at most as many trials as fit run at once. Ray Train places the
  workers in its own placement group, outside the trial's, so starting more trials than fit would
  leave their drivers holding CPUs their workers wait for (ray issue 54305).
- The sweep's options are saved as ``EXPERIMENT/sweep.yaml`` before the first trial: a resume needs
  nothing else. A trial's Train run is ``EXPERIMENT/train-<trial id>``, so a trial interrupted
  mid-run continues from its last checkpoint when the sweep resumes.
- A failed trial is recorded (Tune's ``max_failures=0``) and the sweep goes on; a resume finishes
  unfinished trials and neither reruns finished ones nor retries failed ones.
- A trial Tune stops (ASHA, Ctrl+C) leaves no resources behind: ``ReleaseStoppedWorkerGroups``
  removes the placement group of every Train run whose controller died with its trial.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ray import tune

from raytrain_mp.cluster import cluster_totals, resolve_use_gpu, wait_for_autoscaler
from raytrain_mp.config import absolute_path, to_yaml
from raytrain_mp.data import read_meta, resolve_dataset
from raytrain_mp.ddp.trainer import (
    with_checked_data,
    with_cluster_settings,
)
from raytrain_mp.errors import UsageError
from raytrain_mp.progress import note
from raytrain_mp.storage import join, locate
from raytrain_mp.tracking import end_children, tracked
from raytrain_mp.tune.config import (
    PER_TRIAL,
    SWEEP_FILE,
    TRIAL_DRIVER_CPUS,
    concurrency,
)
from raytrain_mp.tune.report import (
    BEST_FILE,
    PLOT_FILE,
    TABLE_NAME,
    TrialOutcome,
    table_rows,
    write_file,
    write_outputs,
)
from raytrain_mp.tune.search import param_space, scheduler, search_alg
from raytrain_mp.tune.trainable import ReleaseStoppedWorkerGroups, run_name, trial_function


def prepared(cfg: Any) -> Any:
    """``cfg`` with its data checked (the built-in default prepared), local paths absolute (trials
    run in their own folders) and the experiment named; needs no Ray. ``data`` stays as the user
    gave it (None: the built-in default), so ``sweep.yaml`` and ``best.yaml`` do not pin this
    machine's cache folder; ``run_sweep`` resolves it for the trials."""
    checked = with_checked_data(dataclasses.replace(cfg.template(), global_batch_size=min(cfg.global_batch_sizes)))
    data = checked.data
    train_count = read_meta(data).counts["train"]
    too_big = [b for b in cfg.global_batch_sizes if b > train_count]
    if too_big:
        raise UsageError(f"--global-batch-sizes: {too_big[0]} exceeds the {train_count} training samples")
    cfg = dataclasses.replace(
        cfg,
        data=absolute_path(cfg.data),
        weights=checked.weights,  # a torchvision name resolved to its cached file, as ddp's driver does
        preprocess=checked.preprocess,
        storage_path=absolute_path(cfg.storage_path),
        name=cfg.name or time.strftime("tune-%Y%m%d-%H%M%S"),
    )
    experiment = locate(cfg.storage_path, "--storage-path").child(cfg.name)
    if cfg.resume is None and experiment.exists():
        raise UsageError(
            f"--name: {experiment.uri} exists; finish it with --resume {experiment.uri}, or choose another --name"
        )
    return cfg


class SaveFinishedResults(tune.Callback):
    """Make a finished trial's saved last result carry Tune's ``done``, as the live one does.

    When a trial's function returns, Tune sets ``done`` on the trial's last result in place, which
    does not clear the JSON its run metadata cached at the previous experiment save; the state file
    then keeps the result without ``done`` and a resumed sweep would count the trial unfinished.
    Clearing the cache when the trial completes makes the final save write the result as it is."""

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        trial.run_metadata.invalidate_cache()


def run_sweep(cfg: Any) -> dict[str, Any]:
    """Run (or, with ``cfg.resume``, finish) the sweep on the connected cluster; write its outputs
    and return the summary. ``cfg`` must come from ``prepared``."""
    use_gpu = resolve_use_gpu(cfg.use_gpu, int(cfg.num_workers), "workers")
    # One trial's driver and workers, waited for on a joined cluster before the concurrency counts it.
    worker = {"CPU": cfg.cpus_per_worker, "GPU": int(use_gpu)}
    wait_for_autoscaler(
        f"--num-workers {cfg.num_workers}", [{"CPU": TRIAL_DRIVER_CPUS}, *[worker] * int(cfg.num_workers)]
    )
    max_concurrent = concurrency(cfg, *cluster_totals(), use_gpu)
    if cfg.scheduler == "pbt" and max_concurrent < cfg.num_trials():
        # PBT compares trials that run together; one that starts after another finished exploits nothing of it
        note(
            f"note: pbt runs {max_concurrent} of the {cfg.num_trials()} trials at once (what fits), and a trial "
            "exploits only those running beside it; give the cluster more CPUs or run fewer trials"
        )
    experiment = cfg.resume or join(cfg.storage_path, cfg.name)
    # --mlflow: the sweep is a parent run, each trial's run its child (tune.trainable); --resume continues them.
    files = (f"{TABLE_NAME}.csv", PLOT_FILE, BEST_FILE)
    with tracked(cfg, locate(experiment, "--storage-path"), "tune", resumes=bool(cfg.resume), files=files) as mlflow:
        try:
            return sweep_trials(cfg, mlflow.config, experiment, use_gpu, max_concurrent)
        finally:
            end_children(mlflow.config)


def sweep_trials(cfg: Any, tracked_cfg: Any, experiment: str, use_gpu: bool, max_concurrent: int) -> dict[str, Any]:
    """Run the sweep's trials and write its outputs (``run_sweep``); ``tracked_cfg``: ``cfg`` with
    its MLflow run, which the trials' runs go under."""
    # The trials' template holds this machine's state (use_gpu, the data's cache folder); the
    # outputs' best.yaml is built from cfg.template(), the options as the user gave them.
    template = dataclasses.replace(
        with_cluster_settings(dataclasses.replace(cfg.template(), use_gpu=use_gpu)),
        name=None,
        data=absolute_path(resolve_dataset(cfg.data)),
        mlflow_run_id=None,
        mlflow_tracking_uri=tracked_cfg.mlflow_tracking_uri,
        mlflow_parent_run_id=tracked_cfg.mlflow_run_id,
    )
    trainable = trial_function(template, experiment)
    if cfg.resume:
        tuner = tune.Tuner.restore(cfg.resume, trainable, resume_unfinished=True, resume_errored=False)
    else:
        # Tune keeps the concurrency it started with when it resumes; saving it lets the resume check it still fits.
        saved = dataclasses.replace(cfg, resume=None, max_concurrent_trials=max_concurrent)
        write_file(experiment, SWEEP_FILE, to_yaml(saved).encode())
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(cfg),
            tune_config=tune.TuneConfig(
                metric=cfg.metric,
                mode=cfg.mode,
                search_alg=search_alg(cfg, max_concurrent),
                scheduler=scheduler(cfg),
                num_samples=1 if cfg.search == "grid" else cfg.num_trials(),
                max_concurrent_trials=max_concurrent,
            ),
            run_config=tune.RunConfig(
                name=cfg.name,
                storage_path=cfg.storage_path,
                failure_config=tune.FailureConfig(max_failures=0),
                # Tune's copies of the trials' checkpoints (PBT exploits them); PBT warns below 3.
                checkpoint_config=tune.CheckpointConfig(num_to_keep=max(3, cfg.num_to_keep)),
                callbacks=[ReleaseStoppedWorkerGroups(), SaveFinishedResults()],
            ),
        )
    results = tuner.fit()
    # Tune marks a trial's last result done when the trial returns or its scheduler stops it; after
    # an interruption (Ctrl+C) the stopped-in-flight and never-started trials lack it.
    unfinished = sum(1 for result in results if not result.error and not result.metrics.get("done"))
    if unfinished:  # the outputs describe finished sweeps only
        return {
            "experiment": experiment,
            "trials": len(results),
            "unfinished": unfinished,
            "resume": f"raytrain-mp tune --resume {experiment}",
            "best": None,
        }
    rows = table_rows([_outcome(result) for result in results], template)
    written = write_outputs(rows, cfg.template(), cfg.metric, cfg.mode, experiment)
    best = written.pop("best")
    return {
        "experiment": experiment,
        **written,
        "metric": cfg.metric,
        "best": {k: best[k] for k in ("trial", *PER_TRIAL, "effective_lr", f"best_{cfg.metric}", "epochs_run")}
        if best
        else None,
        "trials": len(rows),
        "trials_by_status": dict(Counter(row["status"] for row in rows)),
        "max_concurrent_trials": max_concurrent,
    }


def _outcome(result: Any) -> TrialOutcome:
    """A Tune ``Result`` as the report's plain record."""
    frame = result.metrics_dataframe
    history = []
    if frame is not None and "epoch" in frame:
        columns = [c for c in ("epoch", "val_accuracy", "val_loss", "world_size") if c in frame]
        history = frame[columns].dropna().astype(float).to_dict("records")
    # A trial that failed before its first report has no config in its result; params.json, written
    # when the trial starts, has it for every trial. The result's is the last (PBT's perturbed) one.
    params = result.config
    if not params:
        with result.filesystem.open_input_stream(f"{result.path}/params.json") as f:
            params = json.loads(f.read())
    metrics = result.metrics or {}
    trial_id = metrics.get("trial_id")  # Tune adds it to every report
    return TrialOutcome(
        trial=Path(result.path).name,
        params={k: params[k] for k in PER_TRIAL if k in params},  # a sweep from before a dimension: the template's
        history=history,
        error=str(result.error) if result.error else None,
        run=metrics.get("run") or (run_name(trial_id) if trial_id else None),  # a PBT trial's newest run
    )
