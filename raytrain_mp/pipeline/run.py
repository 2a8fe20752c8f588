"""The ``raytrain-mp pipeline`` training run: epochs of pipelined steps over stage actors.

Reads top to bottom like the DDP loop, but on the driver: data, model, restore, then epochs of
(train with a per-step learning rate, evaluate, checkpoint). Each call to the stage actors runs
``--steps-per-call`` steps, carrying their learning rates, and the next call is queued behind it
(``PipelineTrainer.train_steps``), so the driver reads the next batches while the stages compute.
Invariants:

- Sample order is a pure function of (seed, epoch): a seeded permutation, full batches only, so a
  resumed run sees the same batches an uninterrupted one would.
- A checkpoint folder holds one merged ``model.pt`` (the plain model's state dict, loadable with
  ``strict=True``) and ``train_state.pt`` with each stage's optimizer state; it is written into a
  local temporary folder and published as ``STORAGE/NAME/checkpoint_EEEEEE`` (``storage``: renamed
  locally, uploaded with a completion marker last on object stores), so it is never half there,
  and resuming only ever picks a complete one.
- A stage failure (``StageFailedError``) with failures left rebuilds every stage actor of every
  replica from the newest checkpoint (or the initial model when there is none yet) and continues
  from there.
- With ``--replicas`` R the replicas' shares of a step are exactly the step's global batch, and a
  checkpoint holds one model and one optimizer state per stage (the replicas hold the same), so
  it does not depend on R: a resume may use another R and keeps the math.
- The stage split is part of the run: checkpoints record it (``train_state["split_points"]``, the
  first block of every stage but the first), and a resume, rerun or restart cuts the model there
  instead of balancing again, since each stage's optimizer state fits only its own parameters. A
  different ``--split-points``, ``--stages`` or ``--virtual-stages`` on resume is one error line,
  before Ray starts (the checkpoint's optimizer states say how many stage actors trained it).
- A rerun of a finished run (``result.json`` beside the checkpoints) prints its summary and starts
  nothing (``cli``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import ray
import torch
from torch import nn
from torch.utils.data import DataLoader

from raytrain_mp.checkpointing import MODEL_FILE, load_checkpoint, load_train_state, rng_states, set_rng_states, write_checkpoint, write_result
from raytrain_mp.config import absolute_path, to_yaml
from raytrain_mp.pipeline.config import PipelineConfig, as_flag_error
from raytrain_mp.data import ParquetImageDataset, read_meta
from raytrain_mp.data.dataset import checked_dataset
from raytrain_mp.errors import UsageError
from raytrain_mp.storage import Location, check_reachable, delete_folder, is_complete, latest_complete, locate, publish_folder
from raytrain_mp.lr_schedule import make_schedule
from raytrain_mp.models import build_model, check_model
from raytrain_mp.pipeline import PipelineTrainer, StageFailedError
from raytrain_mp.pipeline.blocks import flatten_model
from raytrain_mp.pipeline.partition import check_stage_count, split_bounds
from raytrain_mp.pipeline.replicas import replica_and_stage
from raytrain_mp.pipeline.schedule import FLAT_SCHEDULES, bubble_for_stage_times

CHECKPOINT_PREFIX = "checkpoint_"
def build_run_model(cfg: PipelineConfig, meta) -> nn.Module:
    """The run's model for the data set ``meta`` describes, in the run's dtype (``models`` adapts
    it to the data: channels, small stem, image size)."""
    dtype = torch.float64 if cfg.precision == "fp64" else torch.float32
    return build_model(cfg.model, meta.num_classes, meta.channels, cfg.small_stem, cfg.weights, image_size=meta.image_size).to(dtype)


def with_checked_inputs(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` with data resolved and checked, the stage cut checked against the model's blocks,
    and the run's name and storage folder fixed: everything that needs no Ray."""
    data, meta = checked_dataset(cfg.data, cfg.global_batch_size, "--global-batch-size")
    check_model(cfg.model, meta.num_classes, meta.channels, meta.image_size, cfg.small_stem, cfg.weights)
    model = build_run_model(cfg, meta)
    # A model cut from its traced graph learns there which shapes cross each cut.
    example = torch.zeros(2, meta.channels, meta.image_size, meta.image_size, dtype=next(model.parameters()).dtype)
    try:
        names = [block.name for block in flatten_model(model, example)]
        check_stage_count(len(names), cfg.stages * cfg.virtual_stages)
        if cfg.split_points:
            split_bounds(names, cfg.split_points, cfg.stages * cfg.virtual_stages)
    except UsageError as exc:
        raise as_flag_error(exc) from None
    name = cfg.name or time.strftime("pipeline-%Y%m%d-%H%M%S")
    cfg = dataclasses.replace(cfg, data=data, name=name, storage_path=absolute_path(cfg.storage_path))
    check_reachable(locate(cfg.storage_path, "--storage-path"), "--storage-path")
    return with_saved_split(cfg, names)


def run_location(cfg: PipelineConfig) -> Location:
    return locate(cfg.storage_path, "--storage-path").child(cfg.name)


def resume_point(cfg: PipelineConfig) -> Location | None:
    """The checkpoint a run continues from: its own newest complete one, else ``--resume-from``."""
    own = latest_complete(run_location(cfg), CHECKPOINT_PREFIX)
    return own or (locate(cfg.resume_from, "--resume-from") if cfg.resume_from else None)


def with_saved_split(cfg: PipelineConfig, names: list[str]) -> PipelineConfig:
    """``cfg`` cut where the checkpoint it resumes from was cut; a different cut of the model's
    blocks ``names`` is a UsageError."""
    resume = resume_point(cfg)
    if resume is None:
        return cfg
    train_state = load_train_state(resume)
    saved = train_state.get("split_points")
    if saved is None:  # a checkpoint from before splits were recorded: balance again
        return cfg
    where = f"{resume.uri} was trained with {len(saved) + 1} stages cut before {','.join(saved) or '(nothing)'}"
    parts = cfg.stages * cfg.virtual_stages
    actors = len(train_state["optimizer"])  # one optimizer state per stage actor
    same_cut = cfg.split_points is None or split_bounds(names, cfg.split_points, parts) == split_bounds(names, saved, len(saved) + 1)
    if not same_cut:
        raise UsageError(
            f"--split-points: {where}, not {','.join(cfg.split_points)}; "
            f"accepted: --split-points {','.join(saved)} (or none), or a new --name to start over"
        )
    if (cfg.stages, parts) != (actors, len(saved) + 1):
        virtual = (len(saved) + 1) // actors
        raise UsageError(
            f"--stages: {where} on {actors} stage actors x {virtual} virtual stages, not --stages {cfg.stages} x "
            f"--virtual-stages {cfg.virtual_stages}; accepted: --stages {actors} --virtual-stages {virtual}, "
            "or a new --name to start over"
        )
    return dataclasses.replace(cfg, split_points=saved)


def local_parent(run: Location) -> str | None:
    """Where a checkpoint is written before publishing: inside a local run folder (so publishing
    is a rename on one filesystem), else the system's temporary folder."""
    if not run.is_local:
        return None
    Path(run.path).mkdir(parents=True, exist_ok=True)
    return run.path


def publish_checkpoint(folder: Path, run: Location, epoch: int, num_to_keep: int) -> Location:
    """Publish a complete local checkpoint folder into the run, then drop the oldest beyond ``num_to_keep``."""
    target = run.child(f"{CHECKPOINT_PREFIX}{epoch:06d}")
    publish_folder(folder, target)
    for old in [f for f in run.folders(CHECKPOINT_PREFIX) if is_complete(f)][:-num_to_keep]:
        delete_folder(old)
    return target


def epoch_batches(length: int, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The epoch's index batches: a seeded permutation cut into full batches."""
    order = torch.randperm(length, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return list(order[: length // batch_size * batch_size].split(batch_size))


def epoch_steps(train, batch_size: int, seed: int, epoch: int, lr_of_step) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
    """The epoch's (inputs, targets, lr) steps; ``train_steps`` reads each while the step before it trains."""
    train_ds, to_input = train
    for step, indices in enumerate(epoch_batches(len(train_ds), batch_size, seed, epoch)):
        images, y, params = train_ds.batch((epoch, int(i)) for i in indices)
        yield to_input(images, params), y, lr_of_step(step)


def evaluate(trainer: PipelineTrainer, loader: DataLoader, to_input) -> dict[str, float]:
    loss_sum = correct = count = 0.0
    for images, y, params in loader:
        logits = trainer.predict(to_input(images, params))
        loss_sum += nn.functional.cross_entropy(logits.double(), y, reduction="sum").item()
        correct += (logits.argmax(dim=1) == y).sum().item()
        count += len(y)
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_count": int(count)}


def maybe_kill_stage(spec: str | None, trainer: PipelineTrainer, epoch: int) -> None:
    """Testing hook: ``INDEX:EPOCH:MARKER`` kills stage actor INDEX (stage INDEX % --stages of
    replica INDEX // --stages) once after EPOCH."""
    if spec is None:
        return
    index, fault_epoch, marker = spec.split(":", 2)
    replica, stage = replica_and_stage(int(index), trainer.num_stages)
    if epoch == int(fault_epoch) and not Path(marker).exists():
        of = f" of replica {replica}" if trainer.num_replicas > 1 else ""
        Path(marker).write_text(f"killed stage {stage}{of} after epoch {epoch}\n")
        ray.kill(trainer.actor(stage, replica))


def run_pipeline(cfg: PipelineConfig) -> dict:
    """Train on the connected Ray cluster; returns the final summary. ``cfg`` must have passed
    ``with_checked_inputs``."""
    torch.manual_seed(cfg.seed)
    dtype = torch.float64 if cfg.precision == "fp64" else torch.float32
    meta = read_meta(cfg.data)
    model = build_run_model(cfg, meta)
    train_ds = ParquetImageDataset(cfg.data, "train", augment=cfg.augment, seed=cfg.seed, meta=meta)
    val_ds = ParquetImageDataset(cfg.data, "val", meta=meta)
    val_loader = DataLoader(val_ds, batch_size=cfg.global_batch_size)
    to_input = partial(train_ds.transform, device=torch.device("cpu"), dtype=dtype)  # the driver feeds stage 0
    to_val_input = partial(val_ds.transform, device=torch.device("cpu"), dtype=dtype)
    steps_per_epoch = len(train_ds) // cfg.global_batch_size
    schedule = make_schedule(
        cfg.base_lr, cfg.global_batch_size, cfg.base_batch, cfg.lr_rule, cfg.warmup_epochs,
        cfg.epochs, steps_per_epoch, cfg.lr_decay, cfg.step_epochs, cfg.gamma,
    )  # fmt: skip
    run = run_location(cfg)
    images, _, params = train_ds.batch(range(cfg.global_batch_size))
    sample = to_input(images, params)  # what time balancing profiles

    failures = 0
    while True:
        # A rerun of the same name, or a restart after a stage failure, continues from the newest checkpoint.
        resume = resume_point(cfg)
        start_epoch, optimizer_states = 0, None
        if resume is not None:
            model_state, train_state = load_checkpoint(resume)
            model.load_state_dict(model_state, strict=True)
            optimizer_states = train_state["optimizer"]
            set_rng_states(train_state["rng"])
            start_epoch = train_state["epoch"] + 1
            print(f"resuming from {resume.uri} at epoch {start_epoch + 1}", flush=True)
        try:
            trainer = make_trainer(cfg, model, schedule(start_epoch * steps_per_epoch), sample)
        except UsageError as exc:
            raise as_flag_error(exc) from None
        # Restarts keep this cut, also when they come before the first checkpoint; it is settled, so no more trials.
        cfg = dataclasses.replace(cfg, split_points=[plan.blocks[0] for plan in trainer.plan[1:]], balance_trials=0)
        try:
            if optimizer_states is not None:
                trainer.load_optimizer_state_dicts(optimizer_states)
            trainer.steps_done = start_epoch * steps_per_epoch
            print_placement(trainer)
            summary = train_epochs(cfg, trainer, (train_ds, to_input), (val_loader, to_val_input), schedule, steps_per_epoch, start_epoch, run)
            stages = [{**dataclasses.asdict(plan), "node_id": node} for plan, node in zip(trainer.plan, trainer.nodes)]
            places = [replica_and_stage(index, trainer.num_stages) for index in range(len(trainer.nodes))]
            actors = [{"replica": replica, "stage": stage, "node_id": node} for (replica, stage), node in zip(places, trainer.nodes)]
            result = {**summary, "num_nodes": len(set(trainer.nodes)), "stages": stages, "actors": actors, "run": run.uri}
            write_result(run, result)
            return result
        except StageFailedError as exc:
            if failures >= cfg.max_failures:
                raise
            failures += 1
            print(f"{exc}; restarting the stages from the last checkpoint ({failures}/{cfg.max_failures})", flush=True)
        finally:
            trainer.shutdown()


def print_placement(trainer: PipelineTrainer) -> None:
    """The cuts tried (``--balance-trials``), the stages' cut, and the node each (replica, stage) actor landed on."""
    for trial in trainer.balance_trials:
        print(f"balance trial: {describe_trial(trial)}", flush=True)
    if trainer.num_replicas == 1:
        for plan, node in zip(trainer.plan, trainer.nodes):
            print(f"{describe(plan)} on node {node[:8]}", flush=True)
        return
    for plan in trainer.plan:
        print(describe(plan), flush=True)
    for replica in range(trainer.num_replicas):
        nodes = trainer.nodes[replica * trainer.num_stages : (replica + 1) * trainer.num_stages]
        where = ", ".join(f"stage {stage} on node {node[:8]}" for stage, node in enumerate(nodes))
        print(f"replica {replica}: {where}", flush=True)


def describe(plan) -> str:
    seconds = (
        f", {plan.seconds:.3f} s fwd+bwd of which {plan.forward_seconds:.3f} s fwd" if plan.seconds is not None else ""
    )
    return (
        f"stage {plan.index}: {plan.blocks[0]}..{plan.blocks[-1]} ({len(plan.blocks)} blocks, "
        f"{plan.params / 1e6:.2f}M params = {plan.param_share:.1%}{seconds})"
    )


def describe_trial(trial: dict) -> str:
    """One cut ``PipelineTrainer`` tried on running stages (an entry of its ``balance_trials``)."""
    return (
        f"cut before {', '.join(trial['split_points'])}: the profile rates it {trial['profile_score']:.4f} s per "
        f"micro-batch; per stage and micro-batch it ran {'/'.join(f'{s:.4f}' for s in trial['forward_seconds'])} s "
        f"forward, {'/'.join(f'{s:.4f}' for s in trial['backward_seconds'])} s backward; "
        f"bubble {trial['bubble_fraction']:.3f}, {trial['seconds_per_step']:.3f} s per step"
    )


def make_trainer(cfg: PipelineConfig, model: nn.Module, lr: float, sample: torch.Tensor) -> PipelineTrainer:
    balance = None if cfg.split_points else (None if cfg.balance == "none" else cfg.balance)
    return PipelineTrainer(
        model, cfg.stages, split_points=cfg.split_points, balance=balance, schedule=cfg.schedule,
        num_microbatches=cfg.microbatches, optimizer=cfg.optimizer, lr=lr, momentum=cfg.momentum,
        weight_decay=cfg.weight_decay, use_gpu=cfg.use_gpu, deferred_bn=cfg.deferred_bn,
        clip_grad_norm=cfg.clip_grad_norm, autocast_bf16=cfg.precision == "bf16", memory_format=cfg.memory_format,
        placement_strategy=cfg.placement, cpus_per_stage=cfg.cpus_per_stage, sample_input=sample,
        virtual_stages=cfg.virtual_stages, num_replicas=cfg.replicas, balance_trials=cfg.balance_trials if balance == "time" else 0,
    )  # fmt: skip


def stage_time_metrics(stats: dict, cfg: PipelineConfig) -> dict:
    """Each rank's computing seconds per step (the first replica's), and for the flat schedules the
    bubble those stage times alone would leave (``schedule.bubble_for_stage_times``): the measured
    bubble minus it is what transfers and calls cost, the rest is the cut's imbalance."""
    steps = max(stats["steps"], 1)
    busy, forward = (stats[key][: cfg.stages] for key in ("busy_seconds", "forward_busy_seconds"))
    metrics = {"stage_seconds_per_step": [seconds / steps for seconds in busy]}
    if cfg.schedule in FLAT_SCHEDULES and cfg.virtual_stages == 1 and stats["steps"]:
        forward_part = forward if cfg.schedule == "gpipe" else None  # GPipe's phases count apart
        metrics["bubble_for_stage_times"] = bubble_for_stage_times(busy, cfg.microbatches, forward_part)
    return metrics


def describe_stage_times(metrics: dict) -> str:
    seconds = "/".join(f"{s:.3f}" for s in metrics["stage_seconds_per_step"])
    predicted = metrics.get("bubble_for_stage_times")
    return f" (stage times {seconds} s/step" + (f", which predict bubble {predicted:.3f})" if predicted is not None else ")")


def train_epochs(cfg, trainer, train, val, schedule, steps_per_epoch, start_epoch, run: Location) -> dict:
    """Epochs of training; ``train`` and ``val`` are each (the data, what makes a model input of a batch)."""
    metrics: dict = {}
    checkpoint = latest_complete(run, CHECKPOINT_PREFIX)
    train_ds, to_input = train
    for epoch in range(start_epoch, cfg.epochs):
        started = time.perf_counter()
        loss_sum = 0.0
        steps = epoch_steps(train, cfg.global_batch_size, cfg.seed, epoch, lambda step, epoch=epoch: schedule(epoch * steps_per_epoch + step))
        for step, loss in enumerate(trainer.train_steps(steps, steps_per_call=cfg.steps_per_call)):
            loss_sum += loss
            if cfg.log_every and (step + 1) % cfg.log_every == 0:
                print(f"epoch {epoch + 1} step {step + 1}/{steps_per_epoch} loss {loss_sum / (step + 1):.4f}", flush=True)
        elapsed = time.perf_counter() - started
        stats = trainer.stats()
        metrics = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / steps_per_epoch,
            **evaluate(trainer, *val),
            "samples_per_second": steps_per_epoch * cfg.global_batch_size / elapsed,
            "bubble_fraction": stats["bubble_fraction"],
            **stage_time_metrics(stats, cfg),
            "lr": schedule(epoch * steps_per_epoch + steps_per_epoch - 1),
        }
        if not math.isfinite(metrics["train_loss"]):
            raise FloatingPointError(f"non-finite training loss at epoch {epoch + 1}; lower --base-lr")
        if (epoch + 1) % cfg.checkpoint_every == 0 or epoch + 1 == cfg.epochs:
            train_state = {
                "optimizer": trainer.optimizer_state_dicts(),
                "epoch": epoch,
                "rng": rng_states(),
                "split_points": cfg.split_points,
            }
            folder = write_checkpoint(trainer.state_dict(), train_state, to_yaml(cfg), parent=local_parent(run))
            checkpoint = publish_checkpoint(folder, run, epoch + 1, cfg.num_to_keep)
        print(
            f"epoch {epoch + 1}/{cfg.epochs} train_loss {metrics['train_loss']:.4f} val_loss {metrics['val_loss']:.4f} "
            f"val_accuracy {metrics['val_accuracy']:.4f} samples/s {metrics['samples_per_second']:.1f} "
            f"bubble {metrics['bubble_fraction']:.3f}{describe_stage_times(metrics)} lr {metrics['lr']:.5f}",
            flush=True,
        )
        maybe_kill_stage(cfg.inject_fault, trainer, epoch + 1)
    return {
        "val_accuracy": metrics.get("val_accuracy"),
        "val_loss": metrics.get("val_loss"),
        "val_count": metrics.get("val_count"),
        "train_loss": metrics.get("train_loss"),
        "epochs": cfg.epochs,
        "num_stages": cfg.stages,
        "num_replicas": cfg.replicas,
        "num_microbatches": cfg.microbatches,
        "schedule": cfg.schedule,
        "global_batch_size": cfg.global_batch_size,
        "samples_per_second": metrics.get("samples_per_second"),
        "bubble_fraction": metrics.get("bubble_fraction"),
        "stage_seconds_per_step": metrics.get("stage_seconds_per_step"),
        "bubble_for_stage_times": metrics.get("bubble_for_stage_times"),
        "checkpoint": checkpoint.uri if checkpoint else None,
        "model": checkpoint.child(MODEL_FILE).uri if checkpoint else None,
    }
