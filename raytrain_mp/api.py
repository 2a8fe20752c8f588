"""The Python entry points beside the command line: what ``raytrain-mp ddp`` and ``pipeline`` run,
for a user's own script, notebook or Ray job.

Job: ``fit(config)`` trains a ``DDPConfig`` or ``PipelineConfig`` exactly as the command with the
same options does and returns its summary (the dict ``--json`` prints: ``run``, ``model``,
``val_accuracy``, ...); ``build_trainer(config)`` hands over a DDP run's ``TorchTrainer`` unfitted,
to wrap or fit yourself. The Tune trainable is ``tune.trainable.tune_trainable``.

Invariants:
- Validation first, as on the command line: the options, the data set and the model are checked
  before Ray is started or joined, and a bad one raises ``UsageError`` with the flag's one line.
- The process's Ray is used when it is initialized; else ``config.address`` (or ``RAY_ADDRESS``) is
  joined, or a local Ray is started and stopped around the run (``cluster.ray_connection``).
- A run already finished (same ``storage_path`` and ``name``, no more ``epochs``) returns its
  summary and starts nothing; more epochs continue it from its newest checkpoint.
"""

from __future__ import annotations

from typing import Any

from raytrain_mp.checkpointing import finished_result
from raytrain_mp.cluster import ray_connection
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.pipeline.config import PipelineConfig
from raytrain_mp.storage import locate


def fit(config: DDPConfig | PipelineConfig) -> dict[str, Any]:
    """Train ``config``'s run on Ray and return its summary."""
    if isinstance(config, DDPConfig):
        from raytrain_mp.ddp.trainer import run_ddp as run
        from raytrain_mp.ddp.trainer import with_checked_data as checked
    elif isinstance(config, PipelineConfig):
        from raytrain_mp.pipeline.run import run_pipeline as run
        from raytrain_mp.pipeline.run import with_checked_inputs as checked
    else:
        raise TypeError(f"fit takes a DDPConfig or a PipelineConfig, got {type(config).__name__}")
    config.validate()
    cfg = checked(config)
    finished = finished_run(cfg)
    if finished is not None:
        return finished
    with ray_connection(cfg.address, cfg.verbose, cfg.quiet):
        return run(cfg)


def finished_run(cfg: Any) -> dict[str, Any] | None:
    """The summary of ``cfg``'s run when it already trained its ``epochs``; None when it has no
    name or has epochs to go."""
    if cfg.name is None:
        return None
    return finished_result(locate(cfg.storage_path, "--storage-path").child(cfg.name), cfg.epochs)


def build_trainer(config: DDPConfig, callbacks: tuple = ()) -> Any:
    """The ``ray.train.torch.TorchTrainer`` of ``config``, checked as ``fit`` checks it, on the
    connected Ray cluster (call ``ray.init`` first: GPU use and the workers' fit are decided there);
    ``callbacks`` (Ray Train ``UserCallback``s) join its ``RunConfig``. ``.fit()`` it yourself."""
    from raytrain_mp.ddp import trainer

    config.validate()
    return trainer.build_trainer(trainer.with_cluster_settings(trainer.with_checked_data(config)), callbacks)
