"""``raytrain-mp eval``: exact evaluation of a checkpoint on Ray Train workers.

Each of W workers (a ``TorchTrainer`` with no training) rebuilds the model from the checkpoint
(``checkpoint.TrainedRun``) and evaluates its shard of the split, taken by ddp's ``ShardSampler``
(indices r, r + W, ...: disjoint, covering, unpadded), with the loss and top-1 counted as the
trainers' evaluation counts them (``ddp.distributed_eval.evaluate``: a float32-or-wider cross
entropy summed per batch, autocast as the run trained). Sums, never means, are all-reduced: the
loss, top-1 and top-k counts, and the K x K confusion matrix; each rank's predictions are gathered
to rank 0 and put back in sample order.

Invariants: every sample of the split counts exactly once whatever W; on the data and split the run
validated on, the accuracy and count are exactly the run's last ``val_accuracy`` and ``val_count``
and the loss agrees within float rounding of the sum; images are normalized with the mean/std of
the data set the run trained on (or resized, cropped and normalized as its pretrained weights have
it: ``TrainedRun.transform``) (also for ``--data`` of another data set, whose classes and image
shape must be the model's, checked before Ray starts). When the checkpoint's BatchNorm running
statistics cannot have converged in the steps it trained (``bn_momentum``), one ``note:`` line on
stderr says so: its accuracy may be chance for that reason alone.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from functools import partial

import ray.train
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch import nn

from raytrain_mp.checkpointing import CHECKPOINT_PREFIX
from raytrain_mp.cluster import check_fits, resolve_use_gpu
from raytrain_mp.compilation import check_compiler, compiler
from raytrain_mp.config import absolute_path
from raytrain_mp.data import ParquetImageDataset, read_meta
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.ddp.distributed_eval import ShardSampler, all_reduce_sum
from raytrain_mp.epochs import running_stats_note
from raytrain_mp.errors import UsageError
from raytrain_mp.inference.checkpoint import TrainedRun, check_data_fits, load_run
from raytrain_mp.inference.config import EvalConfig
from raytrain_mp.inference.report import default_out, write_eval_outputs
from raytrain_mp.precision import autocast_for
from raytrain_mp.progress import note
from raytrain_mp.storage import name_of
from raytrain_mp.tracking import log_outputs
from raytrain_mp.train_logs import run_config_logging
from raytrain_mp.views import Views

BATCH = 64  # the trainers' validation batch (ddp: max(micro-batch, 64)): the same sums, in the same order per rank
TOP_K = 5


@ray.remote(num_cpus=0)
class Results:
    """Where rank 0 leaves the evaluation for the driver (works across nodes; no shared storage)."""

    def __init__(self) -> None:
        self.value: dict | None = None

    def put(self, value: dict) -> None:
        self.value = value

    def get(self) -> dict | None:
        return self.value


@dataclasses.dataclass(frozen=True)
class EvalJob:
    """What every worker needs: the run (to rebuild the model), the data set and split to read."""

    run: TrainedRun
    data: str
    split: str
    compile: bool = False  # --compile: the eval-mode model compiled on each worker (``compilation``)
    compile_mode: str = "default"
    compile_cache: str | None = None


def with_checked_inputs(cfg: EvalConfig) -> EvalConfig:
    """``cfg`` with the checkpoint resolved (``--checkpoint`` then names the checkpoint folder) and
    ``--data`` resolved and checked against the model; needs no Ray."""
    check_compiler(cfg)
    run, _ = load_run(cfg.checkpoint, cfg.ema)
    data = cfg.data or run.data
    meta = read_meta(data) if cfg.data else run.meta
    if cfg.data:
        check_data_fits(run, meta, cfg.data)
    if cfg.split not in meta.shards:
        raise UsageError(f"--split: {data} has no {cfg.split!r} split; it has {', '.join(sorted(meta.shards))}")
    ParquetImageDataset(data, cfg.split, meta=meta)  # every shard of the split readable, labels in range
    in_run = name_of(run.checkpoint).startswith(CHECKPOINT_PREFIX)
    out = absolute_path(cfg.out) if cfg.out else default_out(run.checkpoint, cfg.split, in_run)
    return dataclasses.replace(cfg, checkpoint=run.checkpoint, data=absolute_path(data), out=out)


def eval_loop_per_worker(config: dict) -> None:
    job: EvalJob = config["job"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(1)
    device = ray.train.torch.get_device()
    run = job.run
    model = run.build().to(device)
    compile = compiler(job)
    model = compile(model) if compile is not None else model
    dtype = run.dtype()
    autocast = autocast_for(run.precision, device)
    meta = read_meta(job.data)
    dataset = ParquetImageDataset(job.data, job.split, meta=meta, views=Views.of(meta, run.options))
    loader = make_loader(
        dataset, BATCH, EpochKeys(ShardSampler(len(dataset), rank, world)), workers=0, persistent=False
    )
    to_input = partial(run.transform(), device=device, dtype=dtype)
    k = meta.num_classes
    top = min(TOP_K, k)
    confusion = torch.zeros(k * k, dtype=torch.float64, device=device)
    loss_sum = correct = correct_top = count = 0.0
    predicted: list[int] = []
    with torch.no_grad():
        for images, y, params in loader:
            x, y = to_input(images, params), y.to(device)
            with autocast():
                logits = model(x)
            loss_sum += nn.functional.cross_entropy(
                logits.to(torch.promote_types(logits.dtype, torch.float32)), y, reduction="sum"
            ).item()
            guess = logits.argmax(dim=1)
            correct += (guess == y).sum().item()
            correct_top += (logits.topk(top, dim=1).indices == y[:, None]).any(dim=1).sum().item()
            count += y.numel()
            confusion += torch.bincount(y * k + guess, minlength=k * k).to(confusion.dtype)
            predicted += guess.tolist()
    loss_sum, correct, correct_top, count = all_reduce_sum([loss_sum, correct, correct_top, count], device)
    if world > 1:
        dist.all_reduce(confusion)
    gathered: list[list[int] | None] = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, predicted)
    else:
        gathered = [predicted]
    in_order = [0] * len(dataset)
    for r, preds in enumerate(gathered):
        in_order[r::world] = preds  # rank r held indices r, r + W, ... in order
    if rank == 0:  # Ray Train keeps metrics only with a checkpoint; the result travels back through an actor
        ray.get(
            config["results"].put.remote(
                {
                    "loss": loss_sum / count,
                    "accuracy": correct / count,
                    f"top{top}_accuracy": correct_top / count,
                    "count": int(count),
                    "confusion": confusion.view(k, k).long().tolist(),
                    "predicted": in_order,
                    "world_size": world,
                }
            )
        )


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate on the connected Ray cluster, write the outputs into ``--out``, return the summary.

    ``cfg`` must have passed ``with_checked_inputs``."""
    use_gpu = resolve_use_gpu(cfg.use_gpu, cfg.num_workers, "workers")
    check_fits("--num-workers", cfg.num_workers, 1, 1 if use_gpu else 0)
    run, _ = load_run(cfg.checkpoint, cfg.ema)
    job = EvalJob(run, cfg.data, cfg.split, cfg.compile, cfg.compile_mode, cfg.compile_cache)
    results = Results.remote()
    with tempfile.TemporaryDirectory(prefix="raytrain-eval-") as storage:  # Ray Train's run folder; nothing is kept
        trainer = TorchTrainer(
            eval_loop_per_worker,
            train_loop_config={"job": job, "results": results},
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=cfg.num_workers,
                use_gpu=use_gpu,
                resources_per_worker={"CPU": 1, **({"GPU": 1} if use_gpu else {})},
            ),
            run_config=RunConfig(
                name=time.strftime("eval-%Y%m%d-%H%M%S"),
                storage_path=storage,
                **run_config_logging(cfg.verbose),
            ),
        )
        trainer.fit()
    metrics = ray.get(results.get.remote())
    ray.kill(results)
    if run.steps_trained is not None:  # its accuracy may be chance for that reason alone
        note(running_stats_note(run.options, run.meta, run.steps_trained))
    meta = read_meta(cfg.data)
    dataset = ParquetImageDataset(cfg.data, cfg.split, meta=meta)
    summary = write_eval_outputs(cfg, run, metrics, meta.class_names, dataset.labels, dataset.ids)
    # --mlflow: into the MLflow run of the checkpoint's run folder, eval/<out folder>/...
    run_folder = run.checkpoint.rstrip("/").rsplit("/", 1)[0]
    outputs = [summary[key] for key in ("eval", "confusion_png", "predictions")]
    log_outputs(cfg, run_folder, f"eval {name_of(run.checkpoint)}", outputs, f"eval/{name_of(cfg.out)}")
    return summary
