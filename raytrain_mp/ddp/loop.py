"""The DDP training loop that every Ray Train worker runs (``train_loop_per_worker``).

Reads top to bottom in named steps: set up, ``build_data``, ``build_ddp``, ``build_worker`` (the
optimization), ``restore``, then epochs of (``train_epoch``, ``epoch_metrics``, ``report_epoch``).
What the pipeline loop decides too is decided as it does, in the shared layer: when a checkpoint
is due, the epoch's line and the run's dtype (``epochs``), the learning rate of each global step
(``lr_schedule.schedule_for``), the ``--inject-fault`` spec (``fault_injection.FaultSpec``) and how a
checkpoint is written and published (``checkpointing``). Invariants that make the trained model
independent of the number of workers:

- The global batch is fixed; each of W ranks takes G / W samples per step from a
  ``DistributedSampler`` (shuffle, seed, ``set_epoch`` every epoch; ``data.repeated``'s, which
  deals the slots of ``--ra-sampler`` alike), so step k of every run sees the same global set of
  samples. An epoch is ``len(train) // G`` full global steps (the tail that does
  not fill a global batch is dropped, as in Goyal et al.), which keeps this true for any split size.
- The loss is a sum over the rank's samples divided by the all-reduced sample count of the whole
  optimizer step, times W because DDP averages gradients over ranks: the gradient is the
  single-process full-batch mean gradient, also when ranks hold different numbers of samples.
- BatchNorm is synchronized (``convert_sync_batchnorm``) unless ``sync_bn`` is off;
  ``--freeze-backbone`` and ``--backbone-lr-scale`` (``finetune``) act on module paths only, alike on every rank.
- Batches arrive as uint8 from ``--loader-workers`` loader processes and become the model's input
  on the device, in its dtype (``ParquetImageDataset.transform``); the augmentation they carry is
  keyed by (seed, epoch, index), so neither the process count nor a resume changes a batch.
- Every rank calls ``ray.train.report`` once per epoch, and after every ``--checkpoint-every-steps``
  steps within one; only rank 0 attaches a checkpoint. A checkpoint holds the position in the
  epoch's sample order, so a group of any size restarted from it (a crash, an elastic resize)
  continues with the next global step on the same samples (``elastic.items_to_skip``), and the
  learning rate follows the global step: the result does not depend on how the group changed.
- Rank 0 keeps the run's log (``run_log``: ``metrics.csv``, TensorBoard events, ``curves.png``) in
  the run folder and publishes it before each checkpoint it writes, so a resume continues it at the
  checkpoint's global step. Its step rows carry rank 0's running loss, as the progress line does.
- Rank 0's lines (the start, progress with the ETA, each epoch's summary) go to the terminal of
  the command that started the run (``watch``), or to its own output in a Tune trial.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import ray.train
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_mp.checkpointing import (
    checkpoint_name,
    checkpoint_state,
    plain_state_dict,
    report_checkpoint,
    resumed_at,
    set_rng_states,
    wait_until_reports_taken,
)
from raytrain_mp.config import to_yaml
from raytrain_mp.data import ParquetImageDataset, read_meta, resolve_dataset
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.data.recipe_draws import pair_inputs, step_mix
from raytrain_mp.data.repeated import RepeatedSampler
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.ddp.distributed_eval import ShardSampler, all_reduce_sum, evaluate, global_count
from raytrain_mp.ddp.elastic import items_to_skip
from raytrain_mp.ddp.execution import Execution, prepare_runner
from raytrain_mp.ddp.restored import Restored, read_restored
from raytrain_mp.ddp.sync_batchnorm import convert_sync_batchnorm
from raytrain_mp.ddp.watch import rank_zero_console
from raytrain_mp.ema import ModelEMA, adjusted_decay
from raytrain_mp.epochs import build_run_model, checkpoint_due, epoch_line, run_dtype, run_input_size
from raytrain_mp.fault_injection import FaultSpec
from raytrain_mp.finetune import freeze_backbone, lr_scales
from raytrain_mp.lr_schedule import schedule_for
from raytrain_mp.niceness import run_at_normal_niceness
from raytrain_mp.optim import build_optimizer, load_under_own_options
from raytrain_mp.precision import autocast_for
from raytrain_mp.progress import Progress
from raytrain_mp.run_log import RunLog
from raytrain_mp.storage import locate
from raytrain_mp.tracking import Tracker
from raytrain_mp.views import Views


def train_loop_per_worker(config: dict) -> None:
    cfg = DDPConfig(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_at_normal_niceness()  # as a torchrun rank runs, not at Ray's 15 (see niceness)
    torch.set_num_threads(cfg.torch_threads)  # Ray sets OMP_NUM_THREADS; torch's pool is ours to size
    device = ray.train.torch.get_device()
    num_nodes = count_nodes(world)
    dtype = run_dtype(cfg.precision)

    data = build_data(cfg, rank, world, device, dtype)
    restored = read_restored(cfg)
    model, ddp, execution = build_ddp(cfg, data, world, device, dtype, restored)
    worker = build_worker(cfg, rank, world, device, model, ddp, execution, data.steps_per_epoch)
    resume_dir, start_epoch, skip, carried = restore(worker, restored, data.steps_per_epoch)
    start_step = start_epoch * data.steps_per_epoch + skip
    worker.history = [*worker.history, [start_step, world]]
    if rank == 0:
        worker.out = rank_zero_console(cfg.name, cfg.quiet)
        resumed = f"resumed from {resume_dir} at epoch {start_epoch + 1}" + (f" step {skip + 1}" if skip else "")
        workers = f"{world} worker{'s' * (world > 1)} on {num_nodes} node{'s' * (num_nodes > 1)} from step {start_step}"
        # then the memory format auto chose, and whether compiling pays (``execution``)
        for line in [resumed] * (resume_dir is not None) + [workers, *execution.lines]:
            worker.out.say(line)
        run = locate(cfg.storage_path, "--storage-path").child(cfg.name)
        # metrics.csv, TensorBoard, curves.png (its lr panel: the schedule at every step)
        worker.log = RunLog(
            run,
            start_step,
            cfg.global_batch_size,
            schedule_for(cfg, data.steps_per_epoch),
            Tracker.of(cfg, warn=lambda line: worker.out.say(f"warning: {line}")),  # --mlflow
        )
    worker.progress = Progress(cfg.epochs, data.steps_per_epoch, cfg.global_batch_size, start_step, cfg.log_every)

    for epoch in range(start_epoch, cfg.epochs):
        first = skip if epoch == start_epoch else 0
        sums, step_lr, seconds = train_epoch(worker, data, epoch, first, carried)
        metrics = epoch_metrics(worker, data, epoch, sums, step_lr, seconds, num_nodes)
        report_epoch(worker, metrics, epoch, data.steps_per_epoch)
        maybe_inject_fault(worker.fault, rank, str(epoch + 1))
    if rank == 0:
        worker.log.close()
    if dist.is_initialized():
        dist.barrier()


@dataclass
class Data:
    """One rank's data: its share of every global batch, its shard of the val split, and how a
    batch becomes the model's input (on the device, in its dtype)."""

    meta: Any
    sampler: EpochKeys
    train_loader: Any
    val_loader: Any
    to_input: Callable
    val_input: Callable
    steps_per_epoch: int
    num_classes: int
    sample_shape: tuple[int, ...]  # of a training micro-batch as the model gets it


@dataclass
class Worker:
    """One rank's training: its place in the group, the model and what steps it, and (rank 0) where
    its lines and its log go."""

    cfg: DDPConfig
    rank: int
    world: int
    device: torch.device
    model: nn.Module  # what the state dicts, the optimizer and the weight average hold
    ddp: DistributedDataParallel  # over the model as it computes (``execution``)
    execution: Execution
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    autocast: Callable
    fault: FaultSpec | None
    ema: ModelEMA | None = None  # --model-ema's average of ``model``
    history: list = field(default_factory=list)  # [global step, world size] of each start of the run
    out: Any = None  # rank 0's console (``watch``)
    log: RunLog | None = None  # rank 0's
    progress: Progress | None = None


def build_data(cfg: DDPConfig, rank: int, world: int, device: torch.device, dtype: torch.dtype) -> Data:
    """Per-rank batch of a fixed global batch; the val split is sharded without padding."""
    root = resolve_dataset(cfg.data)
    meta = read_meta(root)
    views = Views.of(meta, cfg)
    train_ds = ParquetImageDataset(
        root,
        "train",
        augment=cfg.augment,
        seed=cfg.seed,
        meta=meta,
        preprocess=cfg.preprocess,
        recipe=cfg.recipe,
        views=views,
    )
    val_ds = ParquetImageDataset(root, "val", meta=meta, preprocess=cfg.preprocess, views=views)
    micro_batch = cfg.global_batch_size // (world * cfg.grad_accum_steps)
    sampler = EpochKeys(RepeatedSampler(train_ds, cfg.repetitions, num_replicas=world, rank=rank, seed=cfg.seed))
    loading = {"workers": cfg.loaders, "prefetch": cfg.loader_prefetch, "pin": device.type == "cuda"}
    train_loader = make_loader(train_ds, micro_batch, sampler, **loading)
    val_sampler = EpochKeys(ShardSampler(len(val_ds), rank, world))
    val_loader = make_loader(val_ds, max(micro_batch, 64), val_sampler, **loading, persistent=False)
    steps_per_epoch = len(train_ds) // cfg.global_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} exceeds the {len(train_ds)} training samples")
    inputs = {"device": device, "dtype": dtype}
    to_input, val_input = partial(train_ds.transform, **inputs), partial(val_ds.transform, **inputs)
    size = run_input_size(cfg, meta)
    shape = (micro_batch, meta.channels, size, size)
    return Data(meta, sampler, train_loader, val_loader, to_input, val_input, steps_per_epoch, meta.num_classes, shape)


def build_ddp(
    cfg: DDPConfig, data: Data, world: int, device: torch.device, dtype: torch.dtype, restored: Restored | None
) -> tuple[nn.Module, DistributedDataParallel, Execution]:
    """Same seeded init on every rank (DDP broadcasts rank 0's parameters anyway); BatchNorm
    synchronized; DDP over the model in the run's layout, compiled under --compile (``execution``)."""
    torch.manual_seed(cfg.seed)
    model = build_run_model(cfg, data.meta)
    if cfg.sync_bn and world > 1:
        model = convert_sync_batchnorm(model, device=device)
    if cfg.freeze_backbone:  # after the conversion, whose new BatchNorm layers would not keep the freeze
        freeze_backbone(model)
    model.to(device)
    carried = restored.train_state.get("memory_format") if restored is not None else None
    runner, execution = prepare_runner(cfg, model, data.sample_shape, dtype, device, carried)
    ddp = DistributedDataParallel(runner, device_ids=[device.index] if device.type == "cuda" else None)
    return model, ddp, execution


def build_worker(
    cfg: DDPConfig,
    rank: int,
    world: int,
    device: torch.device,
    model: nn.Module,
    ddp: DistributedDataParallel,
    execution: Execution,
    steps_per_epoch: int,
) -> Worker:
    """The optimizer at the schedule's peak lr, the schedule per global step, the fp16 GradScaler,
    the weight average (``--model-ema``)."""
    schedule = schedule_for(cfg, steps_per_epoch)
    scales = lr_scales(model, cfg.backbone_lr_scale) if cfg.backbone_lr_scale != 1 else None
    optimizer = build_optimizer(
        ddp.parameters(), cfg.optimizer, schedule.peak_lr, cfg.momentum, cfg.weight_decay, scales, cfg.norm_weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    autocast = autocast_for(cfg.precision, device)
    ema = None
    if cfg.model_ema:
        decay = adjusted_decay(cfg.model_ema_decay, cfg.model_ema_steps, cfg.global_batch_size, cfg.epochs)
        ema = ModelEMA(model, decay, cfg.model_ema_steps, cfg.warmup_epochs)
    fault = FaultSpec.parse(cfg.inject_fault)
    return Worker(cfg, rank, world, device, model, ddp, execution, optimizer, scheduler, scaler, autocast, fault, ema)


def restore(
    worker: Worker, restored: Restored | None, steps_per_epoch: int
) -> tuple[str | None, int, int, tuple[float, float]]:
    """(where from, epoch, step, the epoch's carried (loss sum, samples)) of the checkpoint the run
    continues from, its states loaded into ``worker``."""
    if restored is None:
        return None, 0, 0, (0.0, 0.0)
    model_state, train_state, ema_state = restored.model_state, restored.train_state, restored.ema_state
    worker.model.load_state_dict(model_state, strict=True)
    load_under_own_options(worker.optimizer, worker.scheduler, train_state["optimizer"], train_state["scheduler"])
    worker.scaler.load_state_dict(train_state["scaler"])
    set_rng_states(train_state["rng"])
    if worker.ema is not None and ema_state is not None:  # else the average starts anew at the next update
        worker.ema.load(ema_state, train_state["ema_averaged"])
    worker.history = train_state.get("world_size_history", [])
    (start_epoch, skip), carried = resumed_at(train_state, steps_per_epoch, (0.0, 0.0))
    return restored.folder, start_epoch, skip, carried


def train_epoch(
    worker: Worker, data: Data, epoch: int, first: int, carried: tuple[float, float]
) -> tuple[list[float], float, float]:
    """Steps ``first``.. of ``epoch``, with a checkpoint after every global step --checkpoint-every-steps
    divides; returns the epoch's all-reduced (loss sum, samples, samples trained here), the lr its
    last step trained with, and its seconds."""
    cfg, steps_per_epoch = worker.cfg, data.steps_per_epoch
    data.sampler.set_epoch(epoch, skip=items_to_skip(first, cfg.global_batch_size, worker.world))
    worker.ddp.train()
    started = time.perf_counter()
    worker.progress.start_epoch()
    batches = iter(data.train_loader)
    # Rank 0 carries the resumed part of the epoch's loss: the epoch's all-reduced sums count it once.
    # The loss sum stays on the device, read only for a progress line or a report.
    carried_loss, samples = carried if (first and worker.rank == 0) else (0.0, 0.0)
    loss_sum = torch.full((), carried_loss, dtype=torch.float64, device=worker.device)
    trained = 0
    mixing = cfg.recipe.mixing
    for step in range(first, steps_per_epoch):
        global_step = epoch * steps_per_epoch + step
        maybe_hold(cfg.hold_at_step, global_step)
        micro = [next(batches) for _ in range(cfg.grad_accum_steps)]
        if mixing:
            micro = mixed(micro, data, cfg, epoch, global_step)
        count, step_lr = train_step(worker, data.to_input, micro, loss_sum)
        if worker.ema is not None:
            worker.ema.after_step(worker.model, epoch, step)
        samples += count
        trained += count
        if worker.execution.watch is not None:  # the first step of this start compiled
            if worker.rank == 0:
                worker.out.say(worker.execution.watch.line())
            worker.execution.watch = None
        update = worker.progress.step(global_step + 1)
        if worker.rank == 0 and update:
            running_loss = loss_sum.item() / samples
            worker.out.progress(worker.progress.line(running_loss), update, worker.progress.at)
            if update == "log":
                worker.log.step(global_step + 1, epoch + 1, running_loss, step_lr)
        if step + 1 < steps_per_epoch and checkpoint_due(cfg, epoch, step + 1, steps_per_epoch):
            epoch_loss = all_reduce_sum([loss_sum, samples], worker.device)
            report(
                worker,
                {"global_step": global_step + 1, "world_size": worker.world},
                epoch,
                step + 1,
                epoch_loss,
                due=True,
            )
        maybe_inject_fault(worker.fault, worker.rank, f"s{global_step + 1}")
    seconds = time.perf_counter() - started
    return all_reduce_sum([loss_sum, samples, float(trained)], worker.device), step_lr, seconds


def mixed(micro: list, data: Data, cfg: DDPConfig, epoch: int, global_step: int) -> list:
    """Micro-batches of (sample, partner) pairs as (mixed input, class probabilities, None): one
    draw of the step (``recipe_draws.step_mix``) for all of them, on every rank."""
    out, mix = [], None
    for images, y, params in micro:  # images (N, 2, C, H, W): each sample, then its partner
        x = pair_inputs(data.to_input, images, params)
        if mix is None:
            mix = step_mix(cfg.mixup_alpha, cfg.cutmix_alpha, tuple(x.shape[-2:]), cfg.seed, epoch, global_step)
        out.append((mix.images(x[:, 0], x[:, 1]), mix.targets(y[:, 0], y[:, 1], data.num_classes, x.dtype), None))
    return out


def train_step(worker: Worker, to_input: Callable, micro: list, loss_sum: torch.Tensor) -> tuple[int, float]:
    """One optimizer step over the micro-batches ``micro`` (DDP syncs gradients on the last); adds
    their loss to ``loss_sum`` in place; returns (their samples, the lr the step trained with). A
    micro-batch is (uint8 images, labels, params), or (input, class probabilities, None) mixed."""
    count = sum(len(y) for _, y, _ in micro)
    scale = worker.world / global_count(count, worker.device)
    for i, (images, y, params) in enumerate(micro):
        x = images if params is None else to_input(images, params)
        y = y.to(worker.device, non_blocking=True)
        sync = worker.ddp.no_sync if i < len(micro) - 1 else nullcontext
        with sync(), worker.autocast():
            logits = worker.ddp(x)
            loss = nn.functional.cross_entropy(logits, y, reduction="sum", label_smoothing=worker.cfg.label_smoothing)
        worker.scaler.scale(loss * scale.to(loss.dtype)).backward()
        loss_sum += loss.detach().double()
    worker.scaler.step(worker.optimizer)
    worker.scaler.update()
    worker.optimizer.zero_grad(set_to_none=True)
    step_lr = worker.optimizer.param_groups[0]["lr"]  # the lr this step trained with, before the schedule moves on
    worker.scheduler.step()
    return count, step_lr


def epoch_metrics(
    worker: Worker, data: Data, epoch: int, sums: list[float], step_lr: float, seconds: float, num_nodes: int
) -> dict:
    """The epoch's metrics from its all-reduced training ``sums`` and an exact evaluation; non-finite ones
    end the run."""
    train_loss_sum, train_samples, trained_here = sums
    ema = {}
    if worker.ema is not None:
        ema = evaluate(worker.ema.module, data.val_loader, data.val_input, worker.device, worker.autocast)
        ema = {"val_loss_ema": ema["val_loss"], "val_accuracy_ema": ema["val_accuracy"]}
    metrics = {
        "epoch": epoch + 1,
        "train_loss": train_loss_sum / train_samples,
        **evaluate(worker.ddp, data.val_loader, data.val_input, worker.device, worker.autocast),
        "samples_per_second": trained_here / seconds,
        "lr": step_lr,
        "world_size": worker.world,
        "num_nodes": num_nodes,
        "global_batch_size": worker.cfg.global_batch_size,
        **ema,
    }
    if not all(math.isfinite(v) for v in metrics.values()):
        raise FloatingPointError(f"non-finite metrics at epoch {epoch + 1}: {metrics}; lower --base-lr")
    return metrics


def report_epoch(worker: Worker, metrics: dict, epoch: int, steps_per_epoch: int) -> None:
    """Rank 0's epoch line and log row, then every rank's report, with a checkpoint when one is due."""
    done = (epoch + 1) * steps_per_epoch
    metrics |= {"global_step": done, "world_size_history": worker.history}
    if worker.rank == 0:
        worker.out.say(epoch_line(metrics, worker.cfg.epochs))
        worker.log.epoch(done, metrics)
    report(
        worker, metrics, epoch, 0, (0.0, 0.0), due=checkpoint_due(worker.cfg, epoch, steps_per_epoch, steps_per_epoch)
    )


def report(worker: Worker, metrics: dict, epoch: int, step: int, epoch_loss: Any, due: bool) -> None:
    """Every rank reports ``metrics`` after ``step`` steps of ``epoch`` (the whole epoch: 0); when a
    checkpoint is ``due``, rank 0 attaches it, with the global (loss sum, samples) of the epoch so far."""
    checkpoint = None
    if due and worker.rank == 0:
        train_state = checkpoint_state(
            epoch,
            step,
            epoch_loss,
            optimizer=worker.optimizer.state_dict(),
            scheduler=worker.scheduler.state_dict(),
            scaler=worker.scaler.state_dict(),
            world_size_history=worker.history,
            memory_format=worker.execution.layout,
            **({"ema_averaged": worker.ema.averaged} if worker.ema is not None else {}),
        )
        ema = plain_state_dict(worker.ema.module) if worker.ema is not None else None
        checkpoint = (plain_state_dict(worker.model), train_state, to_yaml(worker.cfg), ema)
    report_checkpoint(metrics, checkpoint_name(epoch + 1, step), checkpoint, worker.log)


def maybe_inject_fault(fault: FaultSpec | None, rank: int, at: str) -> None:
    """Testing hook (``--inject-fault``): crashes rank INDEX once at WHEN, ``N`` after epoch N or
    ``sS`` after global step S (the marker file says it did). Every rank calls it at the same
    points: at WHEN it is a collective (a barrier)."""
    if fault is None or fault.when != at:
        return
    # A poll that finds the failure before a rank's report loses the checkpoint (a loaded machine)
    wait_until_reports_taken()
    if dist.is_initialized():
        dist.barrier()
    if rank == fault.index and fault.due(at):
        point = fault.mark(f"rank {rank} crashed")
        raise RuntimeError(f"injected fault: rank {rank} {point}")


def maybe_hold(spec: str | None, global_step: int) -> None:
    """Testing hook: ``STEP:MARKER`` holds every rank before global step STEP until MARKER exists,
    so that a test changes the cluster while the run is at a step it knows."""
    if spec is None:
        return
    at, marker = spec.split(":", 1)
    while global_step == int(at) and not Path(marker).exists():
        time.sleep(0.2)


def count_nodes(world: int) -> int:
    """Distinct Ray nodes holding the ranks (by node id: Ray Train's node rank goes by IP, and
    several nodes may share one IP, as in ``ray.cluster_utils.Cluster``)."""
    node_ids: list[str | None] = [None] * world
    dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    return len(set(node_ids))
