"""Run the DDP loop on Ray Train: build the ``TorchTrainer`` from a ``DDPConfig`` and fit it.

Knows Ray Train's configuration objects and nothing of the model's internals. Invariants: the data
set is resolved and validated, and the resource request checked against the cluster, before the
trainer is built; NCCL is the backend exactly when workers hold GPUs, gloo otherwise. An elastic
``--num-workers MIN-MAX`` becomes Ray Train's elastic ``ScalingConfig``: the cluster must fit MIN
workers now, and the GPU choice counts MIN ranks. Ray Train restarts an elastic group at the size
its view of the nodes allows, and that view lags a lost node by up to 20 s: a size chosen from it
never fits, and Ray Train waits its worker-group start timeout (60 s by default) before choosing
again. An elastic run sets that timeout to ``--resize-timeout`` (``controller_env``), so a lost
node costs seconds of waiting instead of a minute.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from ray.train import (
    CheckpointConfig,
    ControllerError,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    UserCallback,
    WorkerGroupError,
)
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_mp.checkpointing import EMA_FILE, MODEL_FILE, published_checkpoints, write_result
from raytrain_mp.cluster import check_fits, environment, resolve_use_gpu
from raytrain_mp.config import absolute_path
from raytrain_mp.data import read_meta
from raytrain_mp.data.dataset import checked_dataset
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.ddp.loop import train_loop_per_worker
from raytrain_mp.ddp.watch import Watch
from raytrain_mp.epochs import running_stats_note, with_checked_model
from raytrain_mp.errors import RunFailedError, UsageError
from raytrain_mp.faults import first_line, short_cause
from raytrain_mp.interruption import Interrupted, carried_signal
from raytrain_mp.progress import Console, note
from raytrain_mp.storage import check_reachable, join, locate, name_of
from raytrain_mp.tracking import tracked
from raytrain_mp.train_logs import run_config_logging


def with_checked_data(cfg: DDPConfig) -> DDPConfig:
    """``cfg`` with its data set resolved (the built-in default prepared), every shard checked, and
    the model built and probed on the data's image shape (``epochs.with_checked_model``: ``--weights``
    resolved to a local file, ``--preprocess`` to the run's spec).

    Needs no Ray, so a bad data set or model is reported before any cluster resource is requested."""
    data, meta = checked_dataset(cfg.data, cfg.global_batch_size, "--global-batch-size")
    cfg = with_checked_model(cfg, meta)  # --weights: a local file from here on; --preprocess: the run's spec
    check_reachable(locate(cfg.storage_path, "--storage-path"), "--storage-path")
    return dataclasses.replace(cfg, data=absolute_path(data), resume_from=absolute_path(cfg.resume_from))


def with_cluster_settings(cfg: DDPConfig) -> DDPConfig:
    """``cfg`` with GPU use decided and the request checked against the connected cluster."""
    use_gpu = resolve_use_gpu(cfg.use_gpu, cfg.min_workers, "workers")
    if cfg.precision == "fp16" and not use_gpu:
        raise UsageError("--precision: fp16 needs CUDA (GradScaler); on CPU use bf16 or fp32")
    check_fits("--num-workers", cfg.min_workers, cfg.bundle_cpus, 1 if use_gpu else 0)
    name = cfg.name or time.strftime("ddp-%Y%m%d-%H%M%S")
    return dataclasses.replace(cfg, use_gpu=use_gpu, name=name, storage_path=absolute_path(cfg.storage_path))


# Ray Train's controller reads it from the driver's environment (ray.train.v2's ENV_VARS_TO_PROPAGATE).
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def controller_env(cfg: DDPConfig) -> dict[str, str]:
    """What the driver's environment holds while ``cfg`` is fitted: an elastic run's
    ``--resize-timeout`` as Ray Train's worker-group start timeout; nothing for a fixed size."""
    return {START_TIMEOUT_ENV: str(cfg.resize_timeout)} if cfg.elastic else {}


def build_trainer(cfg: DDPConfig, callbacks: Sequence[UserCallback] = ()) -> TorchTrainer:
    """A TorchTrainer for an already prepared config; ``callbacks`` (e.g. Tune's report) join its RunConfig."""
    resources = {"CPU": cfg.bundle_cpus, **({"GPU": 1} if cfg.use_gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=dataclasses.asdict(cfg),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=(cfg.min_workers, cfg.max_workers) if cfg.elastic else cfg.min_workers,
            elastic_resize_monitor_interval_s=cfg.resize_interval,
            use_gpu=cfg.use_gpu,
            resources_per_worker=resources,
            placement_strategy=cfg.placement,
        ),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=cfg.storage_path,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_to_keep),
            **run_config_logging(cfg.verbose, callbacks),
        ),
    )


def summarize(result, cfg: DDPConfig) -> dict:
    """The final JSON line: last reported metrics plus where the model is, as paths or URIs a user
    can paste back (Ray's checkpoint path has lost the URI's scheme and query)."""
    metrics = dict(result.metrics or {})
    run = join(cfg.storage_path, cfg.name)
    checkpoint = join(run, name_of(result.checkpoint.path)) if result.checkpoint is not None else None
    ema = {name: metrics[name] for name in ("val_accuracy_ema", "val_loss_ema") if name in metrics}
    return {
        "val_accuracy": metrics.get("val_accuracy"),
        "val_loss": metrics.get("val_loss"),
        **ema,
        "val_count": metrics.get("val_count"),
        "train_loss": metrics.get("train_loss"),
        "epochs": metrics.get("epoch"),
        "world_size": metrics.get("world_size"),
        "world_size_history": metrics.get("world_size_history"),
        "num_nodes": metrics.get("num_nodes"),
        "global_batch_size": cfg.global_batch_size,
        "lr": metrics.get("lr"),
        "samples_per_second": metrics.get("samples_per_second"),
        "checkpoint": checkpoint,
        "model": join(checkpoint, MODEL_FILE) if checkpoint else None,
        **({"ema": join(checkpoint, EMA_FILE)} if checkpoint and ema else {}),
        "run": run,
    }


def training_failure(exc: TrainingFailedError) -> str:
    """What ended a fit, in a line: the first failed rank and its cause (``faults.short_cause``),
    or the controller's cause; never the workers' tracebacks Ray Train's message carries."""
    if isinstance(exc, WorkerGroupError) and exc.worker_failures:
        rank = min(exc.worker_failures)
        error = exc.worker_failures[rank]
        # Ray Train wraps what a rank raised (with its traceback as text) or what its health check met.
        error = getattr(error, "_base_exc", None) or getattr(error, "health_check_failure", None) or error
        return f"ddp worker rank {rank} failed: {short_cause(error)}"
    if isinstance(exc, ControllerError):
        return f"ddp: Ray Train's controller failed: {short_cause(exc.controller_failure)}"
    return f"ddp: {first_line(str(exc))}"


def run_ddp(cfg: DDPConfig) -> dict:
    """Fit on the connected Ray cluster, showing rank 0's lines here (``watch``), and return the
    summary; raises on a failed run, ``Interrupted`` (with where the run stands) on a signal.

    ``cfg`` must have passed ``with_checked_data``."""
    cfg = with_cluster_settings(cfg)
    run = locate(cfg.storage_path, "--storage-path").child(cfg.name)
    watch = Watch(cfg.name, Console(quiet=cfg.quiet))
    # Ray Train resumes the run from its newest published checkpoint: its MLflow run goes on too.
    with tracked(cfg, run, "ddp", resumes=bool(published_checkpoints(run)[1])) as mlflow:
        try:
            with environment(controller_env(mlflow.config)):
                summary = summarize(watch.fit(build_trainer(mlflow.config).fit), cfg)
        except TrainingFailedError as exc:  # Ray Train used up --max-failures restarts
            raise RunFailedError.after_restarts(training_failure(exc), cfg.max_failures, cfg.max_failures) from None
        except (Interrupted, SystemError) as exc:
            interrupted = carried_signal(exc)
            if interrupted is None:
                raise
            interrupted.at, interrupted.run = watch.position, run
            raise interrupted from None
        finally:
            watch.console.end_line()  # what follows (a traceback, the interrupt's line) starts on a line of its own
        mlflow.checkpoint = summary["checkpoint"]
    write_result(run, summary)
    meta = read_meta(cfg.data)
    note(running_stats_note(cfg, meta, (summary["epochs"] or 0) * (meta.counts["train"] // cfg.global_batch_size)))
    return summary
