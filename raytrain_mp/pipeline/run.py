"""The ``raytrain-mp pipeline`` training run: epochs of pipelined steps over stage actors.

Reads top to bottom like the DDP loop, but on the driver: data, model, restore, then epochs of
(train with a per-step learning rate, evaluate, checkpoint). Each call to the stage actors runs
``--steps-per-call`` steps, carrying their learning rates, and the next call is queued behind it
(``PipelineTrainer.train_data_steps``). The driver reads no data: each replica's first stage reads
its share of every batch with its own loader processes and its last stage the labels (``feed``);
the driver's calls carry step positions and learning rates.
Invariants:

- Sample order is a pure function of (seed, epoch): a seeded permutation, full batches only
  (``feed.epoch_batches``), so a resumed run sees the same batches an uninterrupted one would.
- ``--checkpoint-every-steps K`` also checkpoints after every global step that K divides, with
  the position in the epoch and the epoch's loss so far; a restart (a stage failure, a rerun of
  the name, another ``--replicas``) continues with the next global step on the same samples, at
  the learning rate of that global step, as DDP's does.
- A checkpoint folder holds one merged ``model.pt`` (the plain model's state dict, loadable with
  ``strict=True``) and ``train_state.pt`` with each stage's optimizer state; it is written into a
  local temporary folder and published as ``STORAGE/NAME/checkpoint_EEEEEE`` (or
  ``checkpoint_EEEEEE_step_SSSSSS`` within an epoch, ``checkpointing.checkpoint_name``;
  ``checkpointing.publish_checkpoint``: renamed locally, uploaded with a completion marker last on
  object stores), so it is never half there, and resuming only ever picks a complete one.
- What the DDP loop decides too is decided as it does, in the shared layer: when a checkpoint is
  due, the epoch's line and the run's dtype (``epochs``), the learning rate of each global step
  (``lr_schedule.schedule_for``), the ``--inject-fault`` spec (``fault_injection.FaultSpec``).
- A stage failure (``StageFailedError``) with failures left rebuilds every stage actor of every
  replica from the newest checkpoint (or the initial model when there is none yet) and continues
  from there, whatever the phase it came in: the stages' start or rebuild, balance trials,
  loading the optimizer state, a step (and the memory-format timing in it), evaluation, gathering
  a checkpoint. With none left (``--max-failures``, -1: unlimited) the run ends with
  ``RunFailedError``: one line naming the stage, the phase, the cause and the restarts used.
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
- The driver shows the progress with the ETA and each epoch's line (``progress``); on Ctrl-C or
  SIGTERM it stops the stage actors and says where the run stands (``interruption``).
- The driver keeps the run's log (``run_log``: ``metrics.csv``, TensorBoard events, ``curves.png``)
  in the run folder, published before every checkpoint; each attempt (a restart, a rerun)
  continues it from the global step it resumes at.
"""

from __future__ import annotations

import dataclasses
import math
import time

import ray
import torch
from torch import nn

from raytrain_mp.bn_momentum import convergence_note
from raytrain_mp.checkpointing import (
    CHECKPOINT_PREFIX,
    EMA_FILE,
    MODEL_FILE,
    checkpoint_name,
    checkpoint_order,
    checkpoint_state,
    load_checkpoint,
    load_ema,
    load_train_state,
    publish_checkpoint,
    published_checkpoints,
    resumed_at,
    set_rng_states,
    write_result,
)
from raytrain_mp.compilation import compiled_line
from raytrain_mp.config import absolute_path, to_yaml
from raytrain_mp.data import read_meta
from raytrain_mp.data.dataset import checked_dataset
from raytrain_mp.epochs import (
    build_run_model,
    checkpoint_due,
    due_by_steps,
    epoch_line,
    run_input_size,
    with_checked_model,
)
from raytrain_mp.errors import OptionError, RunFailedError, UsageError
from raytrain_mp.fault_injection import FaultSpec
from raytrain_mp.interruption import Interrupted, carried_signal
from raytrain_mp.lr_schedule import schedule_for
from raytrain_mp.pipeline import PipelineTrainer, StageFailedError
from raytrain_mp.pipeline.blocks import flatten_model
from raytrain_mp.pipeline.config import FLAG_OF_ARGUMENT, PipelineConfig
from raytrain_mp.pipeline.feed import StageData
from raytrain_mp.pipeline.partition import check_stage_count, split_bounds
from raytrain_mp.pipeline.replicas import replica_and_stage
from raytrain_mp.pipeline.stats import describe_stage_times, stage_time_metrics
from raytrain_mp.pipeline.trials import BalanceTrial
from raytrain_mp.progress import Console, Progress, note
from raytrain_mp.run_log import RunLog
from raytrain_mp.storage import Location, check_reachable, latest_complete, locate
from raytrain_mp.tracking import Tracker, tracked


def with_checked_inputs(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` with data resolved and checked, the stage cut checked against the model's blocks,
    and the run's name and storage folder fixed: everything that needs no Ray."""
    data, meta = checked_dataset(cfg.data, cfg.global_batch_size, "--global-batch-size")
    cfg = with_checked_model(cfg, meta)  # --weights: a local file from here on; --preprocess: the run's spec
    StageData.of_run(cfg, meta)  # its views, checked
    model = build_run_model(cfg, meta)
    example = profile_batch(model, meta, 2, run_input_size(cfg, meta))  # a traced cut learns the shapes crossing it
    try:
        names = [block.name for block in flatten_model(model, example)]
        check_stage_count(len(names), cfg.stages * cfg.virtual_stages)
        if cfg.split_points:
            split_bounds(names, cfg.split_points, cfg.stages * cfg.virtual_stages)
    except OptionError as exc:
        raise exc.named(FLAG_OF_ARGUMENT) from None
    name = cfg.name or time.strftime("pipeline-%Y%m%d-%H%M%S")
    cfg = dataclasses.replace(cfg, data=data, name=name, storage_path=absolute_path(cfg.storage_path))
    check_reachable(locate(cfg.storage_path, "--storage-path"), "--storage-path")
    return with_saved_split(cfg, names)


def run_location(cfg: PipelineConfig) -> Location:
    return locate(cfg.storage_path, "--storage-path").child(cfg.name)


def resume_point(cfg: PipelineConfig) -> Location | None:
    """The checkpoint a run continues from: its own newest complete one, else ``--resume-from``."""
    own = latest_complete(run_location(cfg), CHECKPOINT_PREFIX, checkpoint_order)
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
    same_cut = cfg.split_points is None or split_bounds(names, cfg.split_points, parts) == split_bounds(
        names, saved, len(saved) + 1
    )
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


def save_checkpoint(
    cfg: PipelineConfig, trainer: PipelineTrainer, run: Location, log: RunLog, epoch: int, step: int, loss_sum: float
) -> Location:
    """Checkpoint after ``step`` steps of ``epoch`` (from 0), or after the whole epoch when ``step``
    is 0; ``loss_sum`` is the sum of that epoch's step losses so far."""
    average = {"ema_averaged": trainer.averaged()} if cfg.model_ema else {}
    train_state = checkpoint_state(
        epoch, step, loss_sum, optimizer=trainer.optimizer_state_dicts(), split_points=cfg.split_points, **average
    )
    ema = trainer.state_dict(average=True) if cfg.model_ema else None
    checkpoint = (trainer.state_dict(), train_state, to_yaml(cfg), ema)
    return publish_checkpoint(run, checkpoint_name(epoch + 1, step), checkpoint, log, cfg.num_to_keep)


def step_segments(first: int, steps_per_epoch: int, epoch: int, every: int | None) -> list[range]:
    """The epoch's steps from ``first`` on, cut after every global step that ``every`` divides
    (``--checkpoint-every-steps``, ``epochs.due_by_steps``): a checkpoint follows each segment but the last."""
    done = epoch * steps_per_epoch
    cuts = [step for step in range(first + 1, steps_per_epoch) if due_by_steps(done + step, every)]
    bounds = [first, *cuts, steps_per_epoch]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def profile_batch(model: nn.Module, meta, batch_size: int, size: int) -> torch.Tensor:
    """A batch of the model input's shape (``size`` square) to profile and trace on: standard normal values, as
    normalized images have, drawn from a generator of its own (the run's random state stays as it was)."""
    dtype = next(model.parameters()).dtype
    shape = (batch_size, meta.channels, size, size)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=dtype)


def maybe_kill_stage(fault: FaultSpec | None, trainer: PipelineTrainer, at: str) -> None:
    """Testing hook (``--inject-fault``): kills stage actor INDEX (stage INDEX % --stages of
    replica INDEX // --stages) once at WHEN: ``E`` after epoch E, ``sS`` after global step S."""
    if fault is None or not fault.due(at):
        return
    replica, stage = replica_and_stage(fault.index, trainer.num_stages)
    of = f" of replica {replica}" if trainer.num_replicas > 1 else ""
    fault.mark(f"killed stage {stage}{of}")
    ray.kill(trainer.actor(stage, replica))


def run_pipeline(cfg: PipelineConfig) -> dict:
    """Train on the connected Ray cluster; returns the final summary. ``cfg`` must have passed
    ``with_checked_inputs``."""
    torch.manual_seed(cfg.seed)
    meta = read_meta(cfg.data)
    model = build_run_model(cfg, meta)
    data = StageData.of_run(cfg, meta)
    steps_per_epoch = meta.counts["train"] // cfg.global_batch_size
    schedule = schedule_for(cfg, steps_per_epoch)
    run = run_location(cfg)
    # what time balancing profiles
    sample = profile_batch(model, meta, cfg.global_batch_size, run_input_size(cfg, meta))
    console = Console(quiet=cfg.quiet)

    failures = 0
    progress = None  # the attempt's, once it trains
    # A rerun continues the run from its newest checkpoint: its MLflow run goes on too.
    with tracked(cfg, run, "pipeline", resumes=bool(published_checkpoints(run)[1])) as mlflow:
        cfg = mlflow.config
        try:
            while True:
                # A rerun of the same name, or a restart after a stage failure, continues from the newest checkpoint.
                resume = resume_point(cfg)
                position, carried, optimizer_states, ema_state = (0, 0), 0.0, None, None
                if resume is not None:
                    (model_state, train_state), ema_state = load_checkpoint(resume), load_ema(resume)
                    model.load_state_dict(model_state, strict=True)
                    optimizer_states = train_state["optimizer"]
                    set_rng_states(train_state["rng"])
                    position, carried = resumed_at(train_state, steps_per_epoch, 0.0)
                    at = f" step {position[1] + 1}" if position[1] else ""
                    console.say(f"resuming from {resume.uri} at epoch {position[0] + 1}{at}")
                steps_done = position[0] * steps_per_epoch + position[1]
                # Every phase an actor can be lost in counts against --max-failures: the stages' start,
                # balance trials, loading the optimizer state, steps, evaluation and checkpoints alike.
                try:
                    try:
                        trainer = make_trainer(cfg, model, schedule(steps_done), sample, data)
                    except OptionError as exc:
                        raise exc.named(FLAG_OF_ARGUMENT) from None
                    try:
                        # Restarts keep this cut, also before the first checkpoint; it is settled, so no more trials.
                        cfg = dataclasses.replace(
                            cfg, split_points=[plan.blocks[0] for plan in trainer.plan[1:]], balance_trials=0
                        )
                        if optimizer_states is not None:
                            trainer.load_optimizer_state_dicts(optimizer_states)
                        if cfg.model_ema and ema_state is not None:  # else the average starts anew at the next update
                            trainer.load_state_dict(ema_state, average=True, averaged=train_state["ema_averaged"])
                        trainer.steps_done = steps_done
                        print_placement(trainer, console)
                        progress = Progress(
                            cfg.epochs, steps_per_epoch, cfg.global_batch_size, steps_done, cfg.log_every
                        )
                        summary = train_epochs(cfg, trainer, schedule, position, carried, run, progress, console)
                        result = {**summary, **placement_summary(trainer), "run": run.uri}
                        write_result(run, result)
                        console.end_line()
                        note(convergence_note(model, cfg.epochs * steps_per_epoch))
                        mlflow.checkpoint = result["checkpoint"]
                        return result
                    finally:
                        trainer.shutdown()
                except StageFailedError as exc:
                    if cfg.max_failures != -1 and failures >= cfg.max_failures:
                        raise RunFailedError.after_restarts(str(exc), failures, cfg.max_failures) from None
                    failures += 1
                    of = "unlimited" if cfg.max_failures == -1 else cfg.max_failures
                    console.say(f"{exc}; restarting the stages from the last checkpoint ({failures}/{of})")
                    if cfg.verbose and exc.__cause__ is not None:  # Ray's whole account, which the line sums up
                        console.say(str(exc.__cause__))
        except (Interrupted, SystemError) as exc:
            interrupted = carried_signal(exc)
            if interrupted is None:
                raise
            interrupted.at, interrupted.run = progress.at if progress else None, run
            raise interrupted from None
        finally:
            console.end_line()  # what follows (a traceback, the interrupt's line) starts on a line of its own


def placement_summary(trainer: PipelineTrainer) -> dict:
    """Where the run trained: each stage's cut and node, each actor's (replica, stage) and node."""
    stages = [{**dataclasses.asdict(plan), "node_id": node} for plan, node in zip(trainer.plan, trainer.nodes)]
    places = [replica_and_stage(index, trainer.num_stages) for index in range(len(trainer.nodes))]
    actors = [
        {"replica": replica, "stage": stage, "node_id": node} for (replica, stage), node in zip(places, trainer.nodes)
    ]
    return {"num_nodes": len(set(trainer.nodes)), "stages": stages, "actors": actors}


def print_placement(trainer: PipelineTrainer, console: Console) -> None:
    """The cuts tried (``--balance-trials``), the stages' cut, and the node each (replica, stage) actor landed on."""
    for trial in trainer.balance_trials:
        console.say(f"balance trial: {describe_trial(trial)}")
    if trainer.num_replicas == 1:
        for plan, node in zip(trainer.plan, trainer.nodes):
            console.say(f"{describe(plan)} on node {node[:8]}")
        return
    for plan in trainer.plan:
        console.say(describe(plan))
    for replica in range(trainer.num_replicas):
        nodes = trainer.nodes[replica * trainer.num_stages : (replica + 1) * trainer.num_stages]
        where = ", ".join(f"stage {stage} on node {node[:8]}" for stage, node in enumerate(nodes))
        console.say(f"replica {replica}: {where}")


def describe(plan) -> str:
    seconds = (
        f", {plan.seconds:.3f} s fwd+bwd of which {plan.forward_seconds:.3f} s fwd" if plan.seconds is not None else ""
    )
    return (
        f"stage {plan.index}: {plan.blocks[0]}..{plan.blocks[-1]} ({len(plan.blocks)} blocks, "
        f"{plan.params / 1e6:.2f}M params = {plan.param_share:.1%}{seconds})"
    )


def describe_trial(trial: BalanceTrial) -> str:
    """One cut ``PipelineTrainer`` tried on running stages (an entry of its ``balance_trials``)."""
    return (
        f"cut before {', '.join(trial.split_points)}: the profile rates it {trial.profile_score:.4f} s per "
        f"micro-batch; per stage and micro-batch it ran {'/'.join(f'{s:.4f}' for s in trial.forward_seconds)} s "
        f"forward, {'/'.join(f'{s:.4f}' for s in trial.backward_seconds)} s backward; "
        f"bubble {trial.bubble_fraction:.3f}, {trial.seconds_per_step:.3f} s per step"
    )


def make_trainer(
    cfg: PipelineConfig, model: nn.Module, lr: float, sample: torch.Tensor, data: StageData
) -> PipelineTrainer:
    return PipelineTrainer.from_spec(model, cfg.pipeline_spec(lr), sample_input=sample, data=data)


def averages_evaluation(trainer: PipelineTrainer) -> dict:
    """``val_loss_ema`` and ``val_accuracy_ema``: the weight average's evaluation, as DDP's loop names it."""
    evaluation = trainer.evaluate(average=True)
    return {f"{key}_ema": evaluation[key] for key in ("val_loss", "val_accuracy")}


def train_epochs(
    cfg,
    trainer,
    schedule,
    position: tuple[int, int],
    carried: float,
    run: Location,
    progress: Progress,
    console: Console,
) -> dict:
    """Epochs of training from ``position`` (epoch, step), the epoch's step losses so far summing
    to ``carried``; checkpoints after every ``--checkpoint-every-steps`` segment and epoch; the
    progress and each epoch's line on ``console``."""
    metrics: dict = {}
    checkpoint = latest_complete(run, CHECKPOINT_PREFIX, checkpoint_order)
    steps_per_epoch = trainer.steps_per_epoch
    start_epoch, start_step = position
    tracker = Tracker.of(cfg, warn=lambda line: console.say(f"warning: {line}"))  # --mlflow
    log = RunLog(run, start_epoch * steps_per_epoch + start_step, cfg.global_batch_size, schedule, tracker)
    fault = FaultSpec.parse(cfg.inject_fault)
    compiling = cfg.compile  # the stages compile in this start's first call: a line says what it took
    for epoch in range(start_epoch, cfg.epochs):
        first = start_step if epoch == start_epoch else 0
        loss_sum = carried if first else 0.0
        started = time.perf_counter()
        progress.start_epoch()
        for segment in step_segments(first, steps_per_epoch, epoch, cfg.checkpoint_every_steps):
            steps = ((epoch, step, schedule(epoch * steps_per_epoch + step)) for step in segment)
            for step, loss in enumerate(
                trainer.train_data_steps(steps, steps_per_call=cfg.steps_per_call), start=segment.start
            ):
                loss_sum += loss
                if compiling:
                    console.say(compiled_line([counts for counts in trainer.compile_counts if counts is not None]))
                    compiling = False
                done = epoch * steps_per_epoch + step + 1
                due = progress.step(done)
                if due:
                    console.progress(progress.line(loss_sum / (step + 1)), due)
                if due == "log":
                    log.step(
                        done,
                        epoch + 1,
                        loss_sum / (step + 1),
                        schedule(done - 1),
                        trainer.stats(reset=False).bubble_fraction,
                    )
                maybe_kill_stage(fault, trainer, f"s{done}")
            if segment.stop < steps_per_epoch:
                checkpoint = save_checkpoint(cfg, trainer, run, log, epoch, segment.stop, loss_sum)
        elapsed = time.perf_counter() - started
        stats = trainer.stats()
        metrics = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / steps_per_epoch,
            **trainer.evaluate(),
            **(averages_evaluation(trainer) if cfg.model_ema else {}),
            "samples_per_second": (steps_per_epoch - first) * cfg.global_batch_size / elapsed,
            "bubble_fraction": stats.bubble_fraction,
            **stage_time_metrics(stats, cfg.schedule, cfg.stages, cfg.microbatches),
            "lr": schedule(epoch * steps_per_epoch + steps_per_epoch - 1),
        }
        if not math.isfinite(metrics["train_loss"]):
            raise FloatingPointError(f"non-finite training loss at epoch {epoch + 1}; lower --base-lr")
        log.epoch((epoch + 1) * steps_per_epoch, metrics)
        if checkpoint_due(cfg, epoch, steps_per_epoch, steps_per_epoch):
            checkpoint = save_checkpoint(cfg, trainer, run, log, epoch, 0, loss_sum)
        console.say(
            epoch_line(metrics, cfg.epochs, f" bubble {metrics['bubble_fraction']:.3f}{describe_stage_times(metrics)}")
        )
        maybe_kill_stage(fault, trainer, str(epoch + 1))
    log.close()
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
        **({key: metrics.get(key) for key in ("val_accuracy_ema", "val_loss_ema")} if cfg.model_ema else {}),
        **({"ema": checkpoint.child(EMA_FILE).uri} if checkpoint and cfg.model_ema else {}),
    }
