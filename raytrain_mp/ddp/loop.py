"""The DDP training loop that every Ray Train worker runs (``train_loop_per_worker``).

Reads top to bottom: set up, build data and model, restore, then epochs of (train, evaluate,
report). Invariants that make the trained model independent of the number of workers:

- The global batch is fixed; each of W ranks takes G / W samples per step from a
  ``DistributedSampler`` (shuffle, seed, ``set_epoch`` every epoch), so step k of every run sees the
  same global set of samples. An epoch is ``len(train) // G`` full global steps (the tail that does
  not fill a global batch is dropped, as in Goyal et al.), which keeps this true for any split size.
- The loss is a sum over the rank's samples divided by the all-reduced sample count of the whole
  optimizer step, times W because DDP averages gradients over ranks: the gradient is the
  single-process full-batch mean gradient, also when ranks hold different numbers of samples.
- BatchNorm is synchronized (``convert_sync_batchnorm``) unless ``sync_bn`` is off.
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
from functools import partial
from pathlib import Path

import ray.train
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from raytrain_mp.checkpointing import checkpoint_name, load_checkpoint, plain_state_dict, read_checkpoint, resume_position, rng_states, set_rng_states, write_checkpoint
from raytrain_mp.config import to_yaml
from raytrain_mp.niceness import run_at_normal_niceness
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.data import ParquetImageDataset, read_meta, resolve_dataset
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.ddp.elastic import items_to_skip
from raytrain_mp.ddp.distributed_eval import ShardSampler, all_reduce_sum, evaluate, global_count
from raytrain_mp.lr_schedule import make_schedule
from raytrain_mp.storage import join, locate, name_of
from raytrain_mp.models import build_model
from raytrain_mp.optim import build_optimizer
from raytrain_mp.progress import Progress
from raytrain_mp.run_log import RunLog
from raytrain_mp.ddp.watch import rank_zero_console
from raytrain_mp.ddp.sync_batchnorm import convert_sync_batchnorm


def autocast_for(precision: str, device: torch.device):
    if precision == "bf16":
        return partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return partial(torch.autocast, device_type=device.type, dtype=torch.float16)
    return nullcontext


def maybe_inject_fault(spec: str | None, rank: int, at: str) -> None:
    """Testing hook: ``RANK:WHEN:MARKER`` crashes RANK once at WHEN, ``N`` after epoch N or ``sS``
    after global step S (the marker file says it did). Every rank calls it at the same points: at
    WHEN it is a collective (a barrier)."""
    if spec is None:
        return
    fault_rank, when, marker = spec.split(":", 2)
    if when != at:
        return
    # Every rank's report is queued before one of them fails: Ray Train registers a checkpoint
    # only from a poll that finds every rank's report, and a fast poll that finds the failure
    # before rank 0 has written the checkpoint would lose it.
    if dist.is_initialized():
        dist.barrier()
    if rank == int(fault_rank) and not Path(marker).exists():
        what = f"epoch {at}" if at.isdigit() else f"step {at[1:]}"
        Path(marker).write_text(f"rank {rank} crashed after {what}\n")
        raise RuntimeError(f"injected fault: rank {rank} after {what}")


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


def train_loop_per_worker(config: dict) -> None:
    cfg = DDPConfig(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_at_normal_niceness()  # as a torchrun rank runs, not at Ray's 15 (see niceness)
    torch.set_num_threads(cfg.torch_threads)  # Ray sets OMP_NUM_THREADS; torch's pool is ours to size
    device = ray.train.torch.get_device()
    num_nodes = count_nodes(world)
    dtype = torch.float64 if cfg.precision == "fp64" else torch.float32
    autocast = autocast_for(cfg.precision, device)

    # Data: per-rank batch of a fixed global batch; the val split is sharded without padding.
    root = resolve_dataset(cfg.data)
    meta = read_meta(root)
    train_ds = ParquetImageDataset(root, "train", augment=cfg.augment, seed=cfg.seed, meta=meta)
    val_ds = ParquetImageDataset(root, "val", meta=meta)
    micro_batch = cfg.global_batch_size // (world * cfg.grad_accum_steps)
    sampler = EpochKeys(DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed))
    loading = {"workers": cfg.loaders, "prefetch": cfg.loader_prefetch, "pin": device.type == "cuda"}
    train_loader = make_loader(train_ds, micro_batch, sampler, **loading)
    val_sampler = EpochKeys(ShardSampler(len(val_ds), rank, world))
    val_loader = make_loader(val_ds, max(micro_batch, 64), val_sampler, **loading, persistent=False)
    to_input = partial(train_ds.transform, device=device, dtype=dtype)
    steps_per_epoch = len(train_ds) // cfg.global_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} exceeds the {len(train_ds)} training samples")

    # Model: same seeded init on every rank; DDP broadcasts rank 0's parameters anyway.
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, meta.num_classes, meta.channels, cfg.small_stem, cfg.weights, image_size=meta.image_size).to(dtype)
    if cfg.sync_bn and world > 1:
        model = convert_sync_batchnorm(model, device=device)
    model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    schedule = make_schedule(
        cfg.base_lr, cfg.global_batch_size, cfg.base_batch, cfg.lr_rule, cfg.warmup_epochs,
        cfg.epochs, steps_per_epoch, cfg.lr_decay, cfg.step_epochs, cfg.gamma,
    )  # fmt: skip
    optimizer = build_optimizer(ddp.parameters(), cfg.optimizer, schedule.peak_lr, cfg.momentum, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")

    # Restore: Ray's checkpoint (a restarted worker group, or a rerun of the same name) wins over --resume-from.
    start_epoch, skip, history, carried = 0, 0, [], (0.0, 0.0)
    restored = ray.train.get_checkpoint()
    resume_dir = None
    if restored is not None:
        with restored.as_directory() as d:
            model_state, train_state = read_checkpoint(d)
        resume_dir = join(cfg.storage_path, cfg.name, name_of(restored.path))  # Ray's path lacks a URI's scheme
    elif cfg.resume_from:
        model_state, train_state = load_checkpoint(locate(cfg.resume_from, "--resume-from"))
        resume_dir = cfg.resume_from
    if resume_dir is not None:
        ddp.module.load_state_dict(model_state, strict=True)
        optimizer.load_state_dict(train_state["optimizer"])
        scheduler.load_state_dict(train_state["scheduler"])
        scaler.load_state_dict(train_state["scaler"])
        set_rng_states(train_state["rng"])
        start_epoch, skip = resume_position(train_state["epoch"], train_state.get("step", 0), steps_per_epoch)
        history = train_state.get("world_size_history", [])
        carried = train_state.get("epoch_loss", carried) if skip else carried
    start_step = start_epoch * steps_per_epoch + skip
    history = [*history, [start_step, world]]
    out = rank_zero_console(cfg.name, cfg.quiet) if rank == 0 else None
    if rank == 0:
        if resume_dir is not None:
            out.say(f"resumed from {resume_dir} at epoch {start_epoch + 1}" + (f" step {skip + 1}" if skip else ""))
        out.say(f"{world} worker{'s' * (world > 1)} on {num_nodes} node{'s' * (num_nodes > 1)} from step {start_step}")
    run = locate(cfg.storage_path, "--storage-path").child(cfg.name)
    log = RunLog(run, start_step, cfg.global_batch_size) if rank == 0 else None  # metrics.csv, TensorBoard, curves.png
    progress = Progress(cfg.epochs, steps_per_epoch, cfg.global_batch_size, start_step, cfg.log_every)

    def make_checkpoint(last_epoch: int, steps_done: int, epoch_loss: tuple[float, float]) -> ray.train.Checkpoint | None:
        """Rank 0's checkpoint after ``steps_done`` steps of the epoch after ``last_epoch``; None elsewhere."""
        if rank != 0:
            return None
        log.publish()  # the published log covers every step of a checkpoint (a resume truncates it there)
        train_state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": last_epoch,
            "step": steps_done,
            "epoch_loss": epoch_loss,  # the global (loss sum, samples) of the epoch's steps so far
            "world_size_history": history,
            "rng": rng_states(),
        }
        return ray.train.Checkpoint.from_directory(write_checkpoint(plain_state_dict(ddp), train_state, to_yaml(cfg)))

    every_steps = cfg.checkpoint_every_steps or 0
    for epoch in range(start_epoch, cfg.epochs):
        first = skip if epoch == start_epoch else 0
        sampler.set_epoch(epoch, skip=items_to_skip(first, cfg.global_batch_size, world))
        ddp.train()
        started = time.perf_counter()
        progress.start_epoch()
        batches = iter(train_loader)
        # Rank 0 carries the resumed part of the epoch's loss: the epoch's all-reduced sums count it once.
        # The loss sum stays on the device, read only for a progress line or a report.
        carried_loss, samples = carried if (first and rank == 0) else (0.0, 0.0)
        loss_sum = torch.full((), carried_loss, dtype=torch.float64, device=device)
        trained = 0
        for step in range(first, steps_per_epoch):
            global_step = epoch * steps_per_epoch + step
            maybe_hold(cfg.hold_at_step, global_step)
            micro = [next(batches) for _ in range(cfg.grad_accum_steps)]
            scale = world / global_count(sum(len(y) for _, y, _ in micro), device)
            for i, (images, y, params) in enumerate(micro):
                x, y = to_input(images, params), y.to(device, non_blocking=True)
                sync = ddp.no_sync if i < len(micro) - 1 else nullcontext
                with sync(), autocast():
                    logits = ddp(x)
                    loss = nn.functional.cross_entropy(logits, y, reduction="sum")
                scaler.scale(loss * scale.to(loss.dtype)).backward()
                loss_sum += loss.detach().double()
                samples += len(y)
                trained += len(y)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step_lr = optimizer.param_groups[0]["lr"]  # the lr this step trained with, before the schedule moves on
            scheduler.step()
            update = progress.step(global_step + 1)
            if rank == 0 and update:
                running_loss = loss_sum.item() / samples
                out.progress(progress.line(running_loss), update, progress.at)
                if update == "log":
                    log.step(global_step + 1, epoch + 1, running_loss, step_lr)
            if every_steps and (global_step + 1) % every_steps == 0 and step + 1 < steps_per_epoch:
                epoch_loss = all_reduce_sum([loss_sum, samples], device)
                ray.train.report(
                    {"global_step": global_step + 1, "world_size": world},
                    checkpoint=make_checkpoint(epoch - 1, step + 1, epoch_loss),
                    checkpoint_dir_name=checkpoint_name(epoch + 1, step + 1),
                    delete_local_checkpoint_after_upload=True,
                )
            maybe_inject_fault(cfg.inject_fault, rank, f"s{global_step + 1}")
        elapsed = time.perf_counter() - started
        train_loss_sum, train_samples, trained_here = all_reduce_sum([loss_sum, samples, float(trained)], device)

        metrics = {
            "epoch": epoch + 1,
            "train_loss": train_loss_sum / train_samples,
            **evaluate(ddp, val_loader, partial(val_ds.transform, device=device, dtype=dtype), device, autocast),
            "samples_per_second": trained_here / elapsed,
            "lr": step_lr,
            "world_size": world,
            "num_nodes": num_nodes,
            "global_batch_size": cfg.global_batch_size,
        }
        if not all(math.isfinite(v) for v in metrics.values()):
            raise FloatingPointError(f"non-finite metrics at epoch {epoch + 1}: {metrics}; lower --base-lr")
        done = (epoch + 1) * steps_per_epoch
        metrics |= {"global_step": done, "world_size_history": history}
        due = (epoch + 1) % cfg.checkpoint_every == 0 or epoch + 1 == cfg.epochs or (every_steps and done % every_steps == 0)
        if rank == 0:
            out.say(
                f"epoch {epoch + 1}/{cfg.epochs} train_loss {metrics['train_loss']:.4f} "
                f"val_loss {metrics['val_loss']:.4f} val_accuracy {metrics['val_accuracy']:.4f} "
                f"samples/s {metrics['samples_per_second']:.1f} lr {metrics['lr']:.5f}"
            )
            log.epoch(done, metrics)
        ray.train.report(
            metrics,
            checkpoint=make_checkpoint(epoch, 0, (0.0, 0.0)) if due else None,
            checkpoint_dir_name=checkpoint_name(epoch + 1),  # as the pipeline names them
            delete_local_checkpoint_after_upload=True,
        )
        maybe_inject_fault(cfg.inject_fault, rank, str(epoch + 1))
    if rank == 0:
        log.close()
    if dist.is_initialized():
        dist.barrier()
