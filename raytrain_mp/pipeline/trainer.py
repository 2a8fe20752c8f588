"""Pipelined model-parallel training over Ray stage actors: the driver side.

Job: validate the options, cut the model into stages (``blocks`` + ``partition``), start one
``StageWorker`` actor per rank in a placement group, let the ranks form a torch.distributed process
group, and make one call per rank per step: the inputs go to rank 0 and the targets to the last
rank, once; the ranks run the schedule themselves and exchange activations and gradients point to
point (``stage``). Ray owns placement, GPU pinning, lifecycle and failure handling.

With ``num_replicas`` R > 1 (data x pipeline parallelism) there are R such pipelines, each in its
own placement group (the replicas spread over the nodes that can hold one, ``replicas``), all in
one process group; replica r trains on the r-th contiguous share of each batch and the stages
average gradients across replicas before the update (``replica_sync``). Actors are indexed
replica-major: actor ``r * num_stages + s`` is stage s of replica r.

Invariants:
- Every bad input raises ``UsageError`` before a placement group or actor exists.
- A step equals gradient accumulation over the same micro-batches in one process (each
  micro-batch's loss weighted by its share of the batch), followed by the same optimizer step.
  Torch's runtime needs equal micro-batches, so a batch that m does not divide is refused.
- A rank that dies, raises or hangs surfaces as ``StageFailedError`` naming it and the step. When
  several fail, the origin is the one whose actor died, else the one that failed for its own
  reason rather than because a peer stopped answering (a receive times out after
  ``p2p_timeout_s``); when only the latter failed, the origin is a rank that never answered
  (``blame``). On NCCL a rank whose receive times out does not raise: torch's watchdog aborts its
  process. A rank whose process ended that way, or by any signal or crash, while others stay
  silent counts as dead only if they then fail within a receive timeout of the last failure (a
  dead rank's peers give up on it); if they outlive that, it lost its peer, and a silent rank is
  named as on gloo; telling the two apart costs up to one more ``p2p_timeout_s`` (and 20 s). The
  other ranks may be waiting on the failed one, so the trainer stops every rank of every replica;
  rebuild it (from a checkpoint) to go on.
- With replicas, a step equals gradient accumulation over all R x m micro-batches of the batch in
  order, and every replica holds the same parameters and buffers after it.
- ``state_dict()`` is the full model's state dict (original keys, CPU tensors) and loads with
  ``strict=True`` into the model the trainer was built from.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import ray
import torch
from ray.exceptions import RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import Tensor, nn

from raytrain_mp.cluster import reachable, resolve_use_gpu, use_token_if_the_cluster_asks, wait_for_autoscaler
from raytrain_mp.data import read_meta
from raytrain_mp.errors import UsageError
from raytrain_mp.faults import short_cause
from raytrain_mp.pipeline.blame import Kind, blame, failure_kind, unsettled
from raytrain_mp.pipeline.blocks import Block, StageModule, block_parameter_counts, flatten_model
from raytrain_mp.pipeline.feed import StageData, val_chunks
from raytrain_mp.pipeline.handoff import to_wire
from raytrain_mp.pipeline.layouts import MEMORY_FORMATS
from raytrain_mp.pipeline.microbatch import check_microbatches
from raytrain_mp.pipeline.partition import (
    BALANCE_MODES,
    StagePlan,
    balance_bounds,
    balance_fill_drain_bounds,
    check_stage_count,
    cut_score,
    plan_stages,
    rescale_to_measured,
    split_bounds,
)
from raytrain_mp.pipeline.replicas import (
    check_replicas,
    global_rank,
    replica_and_stage,
    replica_nodes,
    replica_resources,
    replica_shares,
)
from raytrain_mp.pipeline.schedule import SCHEDULES, check_schedule, schedule_entry, stage_indices
from raytrain_mp.pipeline.stage import StageConfig, StageWorker, check_optimizer, profile_on_stage_device
from raytrain_mp.pipeline.teardown import stop_actors

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
_PLACEMENT_TIMEOUT_S = 120.0
TRIAL_CUTS = 3  # balance_trials: the most cuts run on the stage actors, the profile's own included
# After a rank fails, how long to wait for its peers' errors before naming the origin: a killed
# actor's peer often reports the broken connection before Ray reports the death.
_FAILURE_GRACE_S = 5.0
# How late after a receive times out NCCL's watchdog may tear its process down: it first waits for
# its debug dump (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, 15 s by default).
_WATCHDOG_DUMP_S = 15.0


class StageFailedError(RuntimeError):
    """A stage actor died or raised; ``stage`` is its index (from 0), ``replica`` its replica (None
    with a single one), ``step`` the train step (from 1) it failed in (with several steps a call,
    the first of the call's), or None outside ``train_step``; ``phase`` what the trainer was doing
    ("at step 3", "while starting", "in a balance trial", ...) and ``cause`` why, in a few words
    (``faults.short_cause``)."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        step: int | None,
        cause: BaseException | str,
        replica: int | None = None,
        phase: str | None = None,
    ) -> None:
        self.stage, self.num_stages, self.step, self.replica = stage, num_stages, step, replica
        self.phase = phase or (f"at step {step}" if step is not None else "outside a train step")
        self.cause = cause if isinstance(cause, str) else short_cause(cause)
        of = f" of replica {replica}" if replica is not None else ""
        super().__init__(f"pipeline stage {stage}{of} (of stages 0-{num_stages - 1}) failed {self.phase}: {self.cause}")

    def during(self, phase: str) -> StageFailedError:
        """The same failure, said to have happened ``phase`` (a caller knows better what it was doing)."""
        return StageFailedError(self.stage, self.num_stages, self.step, self.cause, self.replica, phase)


def _read_errors(refs: Sequence[ray.ObjectRef], timeout_s: float = 10.0) -> None:
    """Read the calls ``refs`` of stopped actors (they fail at once): a failure the trainer
    handles then leaves no unread error for Ray to print with its traceback when it is freed."""
    if not refs:
        return
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        _error_of(ref)


def _error_of(ref: ray.ObjectRef) -> RayError | None:
    # Reading every finished result of a failed step, not only the first error, also keeps Ray
    # from logging each unread error object with its traceback when it is freed.
    try:
        ray.get(ref)
    except RayError as error:
        return error
    return None


def check_resources(
    nodes: Sequence[Mapping[str, float]],
    bundles: Sequence[Mapping[str, float]],
    strategy: str,
    num_replicas: int = 1,
) -> None:
    """Raise ``UsageError`` when the alive ``nodes`` (their total resources) can never hold
    ``num_replicas`` placement groups of the stages' ``bundles`` (one per stage, in order) under
    ``strategy``."""
    if strategy not in PLACEMENT_STRATEGIES:
        raise UsageError(
            f"placement_strategy: unknown strategy {strategy!r}; accepted: {', '.join(PLACEMENT_STRATEGIES)}"
        )
    num_stages = len(bundles)
    what = f"{num_replicas} replicas x {num_stages} stages" if num_replicas > 1 else f"{num_stages} stages"
    need = replica_resources(bundles)
    for resource, amount in need.items():
        have = sum(node.get(resource, 0) for node in nodes)
        if have < num_replicas * amount:
            option = "use_gpu" if resource == "GPU" else "cpus_per_stage"
            amounts = [bundle.get(resource, 0) for bundle in bundles]
            each = (
                f"{amounts[0]:g} each"
                if len(set(amounts)) == 1
                else (
                    f"{'/'.join(f'{a:g}' for a in amounts)} by stage: the first stage's loader processes "
                    "(data.loader_workers) count"
                )
            )
            raise UsageError(
                f"{option}: {what} need {num_replicas * amount:g} {resource} ({each}); the Ray cluster has {have:g}"
            )

    def fits(node: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
        return all(node.get(resource, 0) >= amount for resource, amount in bundle.items())

    shown = (
        dict(bundles[0]) if all(bundle == bundles[0] for bundle in bundles) else [dict(bundle) for bundle in bundles]
    )
    each = "each" if isinstance(shown, dict) else "by stage"
    if strategy == "STRICT_PACK" and not any(fits(node, need) for node in nodes):
        raise UsageError(
            f"placement_strategy: STRICT_PACK needs one node that holds all {num_stages} stages "
            f"({shown} {each}) and no node does; use PACK or SPREAD"
        )
    packed = replica_nodes({str(i): node for i, node in enumerate(nodes)}, num_replicas, bundles)
    if strategy == "STRICT_PACK" and None in packed:
        raise UsageError(
            f"placement_strategy: STRICT_PACK needs a node per replica that holds all its {num_stages} stages "
            f"({shown} {each}); the nodes hold {packed.index(None)} of {num_replicas} replicas; use PACK or SPREAD"
        )
    free = list(nodes)
    for bundle in sorted(bundles, key=lambda b: -sum(b.values())) if strategy == "STRICT_SPREAD" else ():
        node = next((node for node in free if fits(node, bundle)), None)
        if node is None:
            one = "one stage" if isinstance(shown, dict) else "one stage each"
            raise UsageError(
                f"placement_strategy: STRICT_SPREAD needs {num_stages} nodes that each hold {one} ({shown}); use "
                "SPREAD or PACK"
            )
        free.remove(node)


def _check_options(
    model: nn.Module,
    optimizer: str,
    lr: float,
    momentum: float,
    weight_decay: float,
    clip_grad_norm: float | None,
    cpus_per_stage: int,
    p2p_timeout_s: float,
    memory_format: str,
) -> None:
    first = next(model.parameters(), None)
    if first is None:
        raise UsageError("model: has no parameters to train")
    dtype = first.dtype
    if dtype not in (torch.float32, torch.float64):
        raise UsageError(f"model: parameters are {dtype}; use float32 or float64 (bf16 through autocast_bf16)")
    check_optimizer(optimizer, lr, momentum, weight_decay)
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise UsageError(f"clip_grad_norm: must be > 0, got {clip_grad_norm}")
    if cpus_per_stage < 1 or int(cpus_per_stage) != cpus_per_stage:
        raise UsageError(f"cpus_per_stage: must be a whole number >= 1, got {cpus_per_stage}")
    if not p2p_timeout_s > 0:
        raise UsageError(f"p2p_timeout_s: must be > 0 seconds, got {p2p_timeout_s}")
    if memory_format not in MEMORY_FORMATS:
        raise UsageError(f"memory_format: unknown layout {memory_format!r}; accepted: {', '.join(MEMORY_FORMATS)}")


def check_batch(batch: int, num_microbatches: int, num_replicas: int) -> None:
    """Raise ``UsageError`` unless a batch of ``batch`` samples cuts into equal micro-batches."""
    check_microbatches(num_microbatches, batch)
    if batch % num_microbatches:
        raise UsageError(
            f"num_microbatches: {num_microbatches} micro-batches do not divide a batch of {batch} samples; "
            "torch's pipeline runtime needs micro-batches of equal size"
        )
    check_replicas(num_replicas, batch, num_microbatches)


def _check_trials(
    balance: str | None, trials: int, sample_input: Tensor | None, num_microbatches: int, num_replicas: int
) -> None:
    if trials < 0 or int(trials) != trials:
        raise UsageError(f"balance_trials: a whole number of steps >= 0, got {trials}")
    if trials and balance != "time":
        raise UsageError(
            "balance_trials: tries the cuts of balance='time' on running stages; the cut here is "
            f"{balance or 'split_points'}"
        )
    if trials:
        check_batch(len(sample_input), num_microbatches, num_replicas)  # the trial steps run on it


def _balance_mode(
    split_points: Sequence[str] | None, balance: str | None, sample_input: Tensor | None, num_microbatches: int
) -> str | None:
    """The balance mode to use: None when split points decide, "params" when nothing was asked."""
    if split_points is not None:
        if balance is not None:
            raise UsageError("split_points, balance: give one of them, not both")
        return None
    balance = balance or "params"
    if balance not in BALANCE_MODES:
        raise UsageError(f"balance: unknown mode {balance!r}; accepted: {', '.join(BALANCE_MODES)}")
    if balance == "time":
        if sample_input is None:
            raise UsageError("balance: 'time' needs sample_input, a batch like the training batches, to profile on")
        check_microbatches(num_microbatches, len(sample_input))
    return balance


class PipelineTrainer:
    """Train ``model`` cut into stages over ``num_stages`` Ray actors (ranks) with a pipeline schedule.

    ``virtual_stages`` V > 1 (interleaved schedules) cuts the model into ``num_stages * V`` parts
    and rank r holds parts r, r + num_stages, ...; ``split_points`` then names ``num_stages * V - 1``
    cuts. Partition: ``split_points`` (block names to cut before, e.g. ``["layer3"]``), or
    ``balance`` ``"params"`` (equal parameter counts) or ``"time"`` (seconds profiled on one rank's
    device with the first micro-batch of ``sample_input``: equal forward+backward seconds, or for
    ``schedule="gpipe"`` the least largest forward plus largest backward, what its step pays; the
    cut stays when ``set_schedule`` changes the schedule). Neither means ``"params"``.
    ``balance_trials`` N > 0 (with ``"time"``) corrects the profile by the running stages: a
    profile times blocks one at a time and alone, and running stages, which share the machine,
    can take a few percent more or less each, enough to make another cut the better one. The
    profile's cut runs on the stage actors (one untimed step of ``sample_input``, N timed ones);
    each block's profiled seconds are scaled by what its rank measured against the profile
    (``rescale_to_measured``) and cut anew; a new cut runs in turn, up to ``TRIAL_CUTS`` cuts;
    the one with the smallest median bubble stays, built afresh. ``balance_trials`` reports every
    cut run, ``profile`` the (forward, backward) seconds of each block.
    ``memory_format`` is the layout each stage computes in: ``"channels_last"`` (NHWC, the layout
    oneDNN's CPU kernels and GPU tensor cores favour), ``"contiguous"`` (the model's own), or
    ``"auto"`` (default): each rank times each of its stages in both on the first micro-batch of
    every new schedule, m or micro-batch shape, and keeps the faster (``memory_formats`` says what
    each rank chose). Activations and gradients travel between ranks contiguous whatever the
    layout (``memory_format.ChannelsLast``); models without 4-D activations are unaffected.
    ``use_gpu=None`` uses GPUs when the Ray cluster has one for each rank (NCCL between them; gloo
    between CPU ranks), else CPUs. A receive that waits longer than ``p2p_timeout_s`` fails the step
    (on NCCL by torch's watchdog ending the rank's process, its default
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``; ``blame`` lists the modes).

    Models: a torchvision ResNet and an ``nn.Sequential`` are cut by their own rules (``blocks``);
    any other model is cut from its torch.fx graph at module boundaries (``traced``), which needs
    ``sample_input`` whatever the balance, to learn the shapes that cross each cut. Dropout and
    stochastic depth draw random numbers per stage, so a pipelined step equals gradient
    accumulation only for models without them (dropout 0, stochastic depth 0).

    The model itself is left untouched: every rank works on a copy. When Ray is not initialized
    yet, joins ``RAY_ADDRESS`` if set (one error line if nothing answers there) and otherwise
    starts a new local Ray instance, whatever a stale ``ray start`` left behind. Stage indices count
    from 0, steps from 1.

    ``data`` (a ``feed.StageData``): the data-set form. The first stage of each replica reads its
    share of every global batch from the prepared data set itself, with loader processes on its
    node (its bundle reserves their CPUs), and the last stage the labels; ``train_data_steps``
    takes (epoch, step, lr) positions, ``evaluate`` runs the val split, and the driver sends no
    pixels. ``train_step``/``train_steps``/``predict`` take tensors with or without it.

    ``num_replicas`` R: R copies of the pipeline (R x ``num_stages`` actors), each on the r-th
    contiguous share of every batch, which R x ``num_microbatches`` must divide; gradients are
    averaged over the replicas, so a step equals one over the whole batch. Each replica is one
    placement group under ``placement_strategy``; with STRICT_PACK the replicas go to different
    nodes where they can.
    """

    def __init__(
        self,
        model: nn.Module,
        num_stages: int,
        split_points: Sequence[str] | None = None,
        balance: str | None = None,
        schedule: str = "gpipe",
        num_microbatches: int = 4,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        use_gpu: bool | None = None,
        deferred_bn: bool = False,
        clip_grad_norm: float | None = None,
        autocast_bf16: bool = False,
        memory_format: str = "auto",
        placement_strategy: str = "STRICT_PACK",
        cpus_per_stage: int = 1,
        sample_input: Tensor | None = None,
        virtual_stages: int = 1,
        p2p_timeout_s: float = 300.0,
        num_replicas: int = 1,
        balance_trials: int = 0,
        data: StageData | None = None,
    ) -> None:
        # Everything that can be checked without a cluster, first.
        blocks = flatten_model(model, sample_input)
        names = [block.name for block in blocks]
        if virtual_stages < 1:
            raise UsageError(f"virtual_stages: must be >= 1, got {virtual_stages}")
        parts = num_stages * virtual_stages
        check_stage_count(len(blocks), parts)
        self.num_stages, self.virtual_stages, self.layout = num_stages, virtual_stages, schedule_entry(schedule).layout
        self.set_schedule(schedule, num_microbatches)
        _check_options(
            model, optimizer, lr, momentum, weight_decay, clip_grad_norm, cpus_per_stage, p2p_timeout_s, memory_format
        )
        check_replicas(num_replicas)
        self.num_replicas = num_replicas
        self.data = data
        if data is not None:
            meta = read_meta(data.root)
            data.check(meta)
            check_batch(data.global_batch_size, num_microbatches, num_replicas)
            self.steps_per_epoch = meta.counts["train"] // data.global_batch_size
            self._val_count = meta.counts["val"]
            height, width, channels = meta.image_shape
            self._input_shape = (channels, height, width)
        balance = _balance_mode(split_points, balance, sample_input, num_microbatches)
        _check_trials(balance, balance_trials, sample_input, num_microbatches, num_replicas)
        params = block_parameter_counts(model, blocks)
        bounds = split_bounds(names, split_points, parts) if split_points is not None else None
        if balance == "params":
            bounds = balance_bounds(params, parts)

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            joined = reachable(address, "RAY_ADDRESS") if address else "local"
            if address:
                use_token_if_the_cluster_asks(joined)
            ray.init(address=joined)
        alive = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
        nodes = list(alive.values())
        use_gpu = resolve_use_gpu(use_gpu, num_replicas * num_stages, "stage actors")
        bundle = {"CPU": cpus_per_stage, **({"GPU": 1} if use_gpu else {})}
        # The first stage's bundle also reserves a CPU for each of its loader processes.
        loaders = data.loader_workers if data is not None else 0
        self._bundles = [{**bundle, "CPU": cpus_per_stage + loaders * (rank == 0)} for rank in range(num_stages)]
        if wait_for_autoscaler(f"{num_replicas * num_stages} stage actors", self._bundles * num_replicas):
            alive = {
                node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]
            }  # with the nodes it added
            nodes = list(alive.values())
        check_resources(nodes, self._bundles, placement_strategy, num_replicas)

        self.use_gpu = use_gpu
        self.clip_grad_norm = clip_grad_norm
        self.p2p_timeout_s = p2p_timeout_s
        self.steps_done = 0  # train steps completed; the CLI sets it when resuming
        self._queued = 0  # steps submitted and not yet finished (train_steps)
        self._last_finish = 0.0
        self._actors: list[Any] = []
        self._stopped = "shutdown(), which stopped its stage actors"
        # Only STRICT_PACK takes a target node; it spreads the replicas (a hint: Ray may still pack them).
        targets = replica_nodes(alive, num_replicas, self._bundles) if num_replicas > 1 else [None]
        hints = targets if placement_strategy == "STRICT_PACK" else [None] * num_replicas
        self._pgs = [
            placement_group([dict(b) for b in self._bundles], strategy=placement_strategy, _soft_target_node_id=hint)
            for hint in hints
        ]
        try:
            self._wait_for_placement(placement_strategy)
            # The model's own order: a stage attaches a residual block's downsample with its strided conv.
            self._model_keys = list(model.state_dict())
            template = StageConfig(
                rank=0,
                num_ranks=num_stages,
                virtual_stages=virtual_stages,
                optimizer=optimizer,
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                use_gpu=use_gpu,
                num_cpus=cpus_per_stage,
                deferred_bn=deferred_bn,
                autocast_bf16=autocast_bf16,
                memory_format=memory_format,
                p2p_timeout_s=p2p_timeout_s,
                replica=0,
                num_replicas=num_replicas,
                data=data,
                layout=self.layout,
            )
            self.balance_trials: list[dict[str, Any]] = []  # per cut run on the actors, the profile's first
            self.profile: list[tuple[float, float]] | None = None  # per block, (forward, backward) seconds
            seconds = forward = None
            if balance == "time":
                sample = sample_input[: -(-len(sample_input) // num_microbatches)]  # the first micro-batch
                self.profile = self._profile(model, blocks, sample, template)
                forward, backward = (list(phase) for phase in zip(*self.profile))
                seconds = [f + b for f, b in zip(forward, backward)]
                bounds = self._cut(forward, backward)
                if balance_trials:
                    try:
                        bounds = self._fastest_cut(
                            model, blocks, template, bounds, forward, backward, sample_input, balance_trials
                        )
                    except StageFailedError as exc:
                        raise exc.during("in a balance trial") from exc.__cause__
            self.plan: list[StagePlan] = plan_stages(names, bounds, params, seconds, forward)
            self._start_stages(model, blocks, bounds, template)
        except BaseException:
            self.shutdown()
            raise
        self._reset_stats()

    # -- setup ---------------------------------------------------------------------------------

    def _start_stages(
        self, model: nn.Module, blocks: list[Block], bounds: Sequence[int], template: StageConfig
    ) -> None:
        """One actor per rank of every replica, holding its parts of the cut ``bounds``, ready and in
        one process group."""
        num_stages = self.num_stages
        pieces = [StageModule(model, blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
        held = [
            [pieces[i] for i in stage_indices(rank, num_stages, self.virtual_stages, self.layout)]
            for rank in range(num_stages)
        ]
        self._stage_keys = [[key for piece in modules for key in piece.state_dict()] for modules in held]
        actor_class = ray.remote(StageWorker)
        for replica in range(self.num_replicas):
            for rank, modules in enumerate(held):
                config = dataclasses.replace(template, rank=rank, replica=replica)
                options = self._placement(rank, replica)
                self._actors.append(actor_class.options(**options).remote(modules, config))
        starting = "while starting"
        self.devices: list[str] = self._call_all("ready", phase=starting)  # per actor, replica-major
        self.niceness: list[int] = self._call_all("niceness", phase=starting)  # per actor, replica-major
        self.keeps_freed_memory: list[bool] = self._call_all(
            "keeps_freed_memory", phase=starting
        )  # per actor, replica-major
        host, port = self._gather([(0, self.actor(0).host_store.remote())], step=None, phase=starting)[0]
        self._call_all("join_group", host, port, phase=starting)
        self.nodes: list[str] = [  # Ray node id per actor, replica-major
            ray.util.placement_group_table(pg)["bundles_to_node_id"][rank]
            for pg in self._pgs
            for rank in range(num_stages)
        ]

    def _per_rank_and_microbatch(self, timed: Sequence[dict[str, Any]], key: str) -> list[float]:
        """Per rank, its median seconds ``key`` over the ``timed`` steps' stats per micro-batch, the
        replicas' mean."""
        ranks = self.num_stages
        return [
            statistics.mean(
                statistics.median(stats[key][actor] for stats in timed)
                for actor in range(rank, ranks * self.num_replicas, ranks)
            )
            / self.num_microbatches
            for rank in range(ranks)
        ]

    def _cut(self, forward: Sequence[float], backward: Sequence[float]) -> list[int]:
        """Time balance of blocks with these seconds: GPipe's step pays its slowest stage's forward
        and its slowest stage's backward (``balance_fill_drain_bounds``); the other schedules
        alternate the two phases. (``set_schedule`` refuses GPipe with virtual stages.)"""
        parts = self.num_stages * self.virtual_stages
        if SCHEDULES[self.schedule].fill_drain:
            return balance_fill_drain_bounds(forward, backward, parts)
        return balance_bounds([f + b for f, b in zip(forward, backward)], parts)

    def _fastest_cut(
        self,
        model: nn.Module,
        blocks: list[Block],
        template: StageConfig,
        bounds: list[int],
        forward: list[float],
        backward: list[float],
        sample: Tensor,
        steps: int,
    ) -> list[int]:
        """Run ``bounds`` on stage actors of its own (one untimed step of ``sample``, ``steps``
        timed ones), rescale the profile to what each rank measured per micro-batch, cut anew, and
        repeat while the cut is new and fewer than ``TRIAL_CUTS`` have run; the cut with the least
        median bubble. The blocks and so the work are the same on every cut, so the least waiting
        is the shortest step, and a share of a step's time does not drift with a shared machine's
        speed as seconds do."""
        fill_drain = SCHEDULES[self.schedule].fill_drain
        names = [block.name for block in blocks]
        targets = torch.zeros(len(sample), dtype=torch.long)  # any class will do: only the time counts
        ranks = self.num_stages
        tried: list[list[int]] = []
        self._reset_stats()
        while bounds not in tried and len(tried) < TRIAL_CUTS:
            self._start_stages(model, blocks, bounds, template)
            self.train_step(sample, targets)
            self._reset_stats()
            timed = []
            for _ in range(steps):
                self.train_step(sample, targets)
                timed.append(self.stats(reset=True))
            self._stop_actors()
            tried.append(bounds)
            measured_forward = self._per_rank_and_microbatch(timed, "forward_busy_seconds")
            busy = self._per_rank_and_microbatch(timed, "busy_seconds")
            measured_backward = [b - f for b, f in zip(busy, measured_forward)]
            self.balance_trials.append(
                {
                    "split_points": [names[i] for i in bounds[1:-1]],
                    "profile_score": cut_score(forward, backward, bounds, fill_drain),
                    "forward_seconds": measured_forward,  # per rank and micro-batch
                    "backward_seconds": measured_backward,  # the same, with the optimizer step's share
                    "bubble_fraction": statistics.median(t["bubble_fraction"] for t in timed),
                    "seconds_per_step": statistics.median(t["seconds_per_step"] for t in timed),
                }
            )
            bounds = self._cut(
                rescale_to_measured(forward, bounds, ranks, measured_forward),
                rescale_to_measured(backward, bounds, ranks, measured_backward),
            )
        self.steps_done = 0
        return min(tried, key=lambda cut: self.balance_trials[tried.index(cut)]["bubble_fraction"])

    def _placement(self, index: int, replica: int = 0) -> dict[str, Any]:
        return {
            "num_cpus": self._bundles[index]["CPU"],
            "num_gpus": 1 if self.use_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self._pgs[replica], placement_group_bundle_index=index
            ),
        }

    def _wait_for_placement(self, strategy: str) -> None:
        refs = [pg.ready() for pg in self._pgs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_PLACEMENT_TIMEOUT_S)
        if len(ready) < len(refs):
            groups = f"{self.num_replicas} placement groups" if self.num_replicas > 1 else "placement group"
            raise RuntimeError(
                f"{groups} of {self._bundles} ({strategy}) was not ready after "
                f"{_PLACEMENT_TIMEOUT_S:g} s; other jobs may hold the resources"
            )

    def _profile(
        self, model: nn.Module, blocks: list[Block], sample: Tensor, config: StageConfig
    ) -> list[tuple[float, float]]:
        # Profile where rank 0 will run, before its actor takes the bundle: the target device.
        # max_calls=1: the task's worker exits afterwards, so it holds no CUDA context on the GPU and its
        # allocator settings (allocator.keep_freed_memory) die with it.
        task = ray.remote(max_calls=1)(profile_on_stage_device).options(**self._placement(0))
        try:
            return ray.get(
                task.remote(
                    model, blocks, sample, self.use_gpu, config.num_cpus, config.autocast_bf16, config.memory_format
                )
            )
        except RayError as error:  # its process or node lost, as a stage actor's can be
            raise StageFailedError(0, self.num_stages, None, error, phase="while profiling its blocks") from error

    def set_schedule(self, schedule: str | None = None, num_microbatches: int | None = None) -> None:
        """Change the schedule and/or the number of micro-batches for the next steps; the stages,
        their parameters and optimizer state stay (a benchmark sweeps m without restarting)."""
        schedule = self.schedule if schedule is None else schedule
        num_microbatches = self.num_microbatches if num_microbatches is None else num_microbatches
        check_schedule(schedule, self.num_stages, self.virtual_stages, num_microbatches, self.layout)
        self.schedule, self.num_microbatches = schedule, num_microbatches

    @property
    def memory_formats(self) -> list[list[str]]:
        """Per actor (replica-major), the layout each of its stages computes in now: under
        ``memory_format="auto"`` what the last new schedule, m or micro-batch shape measured faster."""
        return self._call_all("memory_formats")

    # -- calls -----------------------------------------------------------------------------------

    def _call_all(self, method: str, *args: Any, phase: str | None = None) -> list[Any]:
        """``method(*args)`` on every actor of every replica; the results, replica-major. A failure
        says it happened ``phase``."""
        refs = [(index, getattr(actor, method).remote(*args)) for index, actor in enumerate(self._all_actors())]
        return self._gather(refs, step=None, phase=phase)

    def _gather(
        self, submitted: list[tuple[int, ray.ObjectRef]], step: int | None, phase: str | None = None
    ) -> list[Any]:
        """The results of ``submitted`` (actor index, ref) pairs, in order. A failure stops every
        rank and raises ``StageFailedError`` for its origin (see the module docstring), at ``step``
        or ``phase``."""
        refs = [ref for _, ref in submitted]
        results: dict[ray.ObjectRef, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[done[0]] = ray.get(done[0])
                continue
            except RayError as error:
                failed = error  # raised outside the handler, so that Ray's error is not its context
            self._fail(submitted, done[0], failed, pending, step, phase)
        return [results[ref] for ref in refs]

    def _fail(
        self,
        submitted: list[tuple[int, ray.ObjectRef]],
        first: ray.ObjectRef,
        error: RayError,
        pending: list[ray.ObjectRef],
        step: int | None,
        phase: str | None = None,
    ) -> NoReturn:
        """Stop every rank and raise ``StageFailedError`` for the origin (``blame.blame``) of a call
        whose ``first`` ref failed first, with ``error``. It waits for the ``pending`` refs first:
        up to ``_FAILURE_GRACE_S`` for their errors, and while the origin is a rank that exited with
        others silent (``blame.unsettled``), until every rank has failed or the silent ones have
        outlived the last failure by a receive timeout (a dead rank's peers fail within one; a hung
        rank, whose waiting peer NCCL's watchdog ended, never fails)."""
        rank_of = {ref: rank for rank, ref in submitted}
        failures = [(rank_of[first], error)]

        def kinds() -> list[tuple[int, Kind]]:
            return [(rank, failure_kind(failure)) for rank, failure in failures]

        last = time.monotonic()
        grace_end, outlived = last + _FAILURE_GRACE_S, False
        while pending:
            waiting = unsettled(kinds(), [rank_of[ref] for ref in pending])
            deadline = (
                max(grace_end, last + self.p2p_timeout_s + _WATCHDOG_DUMP_S + _FAILURE_GRACE_S)
                if waiting
                else grace_end
            )
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                outlived = waiting
                break
            if (later := _error_of(done[0])) is not None:
                failures.append((rank_of[done[0]], later))
                last = time.monotonic()
        index, hung = blame(kinds(), [rank_of[ref] for ref in pending], outlived)
        rank, origin = failures[index]
        if hung is not None:  # its peers waited in vain: name the rank that hangs
            origin = TimeoutError(
                f"it stopped answering; {self._name(rank)[2]} gave up waiting for it: {short_cause(origin)}"
            )
            rank = hung
        self.shutdown()
        _read_errors(pending)
        stage, replica, name = self._name(rank)
        self._stopped = f"a failure of {name}, after which it stopped every stage actor"
        raise StageFailedError(stage, self.num_stages, step, origin, replica, phase) from origin

    def _name(self, rank: int) -> tuple[int, int | None, str]:
        """(stage, replica or None with a single one, "stage S[ of replica R]") of actor ``rank``."""
        replica, stage = replica_and_stage(rank, self.num_stages)
        if self.num_replicas == 1:
            return stage, None, f"stage {stage}"
        return stage, replica, f"stage {stage} of replica {replica}"

    def train_step(self, inputs: Tensor, targets: Tensor, lr: float | None = None) -> float:
        """One optimizer step on the batch (at learning rate ``lr`` when given); returns the batch
        mean cross-entropy loss."""
        (loss,) = self.train_steps([(inputs, targets, lr)], ahead=0)
        return loss

    def train_steps(
        self, batches: Iterable[tuple[Tensor, Tensor, float | None]], ahead: int = 1, steps_per_call: int = 1
    ) -> Iterator[float]:
        """``train_step`` over ``(inputs, targets, lr)`` batches, yielding each step's loss in order.

        ``steps_per_call`` consecutive steps go to the actors in one call each (Keras's
        ``steps_per_execution``): the Ray call's cost is shared by those steps. Up to ``ahead``
        calls wait on the actors behind the running one: a call, and the driver's reading of the
        next batches, happen while the steps before them compute. The actors run their calls in
        order, so the steps are those of ``train_step`` one by one. Every submitted step runs:
        closing the iterator early still waits for the queued ones."""
        return self._pipelined(batches, self._submit, ahead, steps_per_call)

    def train_data_steps(
        self, positions: Iterable[tuple[int, int, float | None]], ahead: int = 1, steps_per_call: int = 1
    ) -> Iterator[float]:
        """``train_steps`` over the data set the trainer was built with (``data``): each
        ``(epoch, step, lr)`` names global step ``step`` (from 0) of ``epoch``'s seeded order
        (``feed.epoch_batches``), which the first stage of every replica reads its share of, and
        the last stage its labels; the calls carry positions and learning rates only."""
        if self.data is None:
            raise UsageError(
                "data: train_data_steps reads the data set given as data=StageData(...); this trainer has none (use "
                "train_steps)"
            )
        return self._pipelined(positions, self._submit_positions, ahead, steps_per_call)

    def _pipelined(self, items: Iterable[Any], submit: Any, ahead: int, steps_per_call: int) -> Iterator[float]:
        if steps_per_call < 1 or ahead < 0:
            raise UsageError(f"steps_per_call must be >= 1 and ahead >= 0, got {steps_per_call} and {ahead}")
        items = iter(items)
        queued: deque[tuple[int, list[tuple[int, ray.ObjectRef]], float, int]] = deque()
        try:
            while chunk := list(itertools.islice(items, steps_per_call)):
                queued.append(submit(chunk))
                if len(queued) > ahead:
                    yield from self._finish(*queued.popleft())
            while queued:
                yield from self._finish(*queued.popleft())
        finally:
            while queued and self._actors:
                self._finish(*queued.popleft())
            # After a failure the actors are gone: the calls queued behind it failed with them.
            _read_errors([ref for _, refs, _, _ in queued for _, ref in refs])

    def _submit(
        self, chunk: list[tuple[Tensor, Tensor, float | None]]
    ) -> tuple[int, list[tuple[int, ray.ObjectRef]], float, int]:
        """Check the batches and hand each rank its share of the steps in one call: (first step
        number, refs, when, steps)."""
        m = self.num_microbatches
        shapes = {tuple(inputs.shape) for inputs, _, _ in chunk}
        if len(shapes) > 1:
            raise UsageError(f"inputs: the batches of one call must have one shape, got {sorted(shapes)}")
        for inputs, targets, _ in chunk:
            batch = len(inputs)
            check_batch(batch, m, self.num_replicas)
            if len(targets) != batch:
                raise UsageError(f"targets: {len(targets)} targets for {batch} inputs")
        inputs = chunk[0][0]
        shape = (len(inputs) // (self.num_replicas * m), *inputs.shape[1:])
        shares = [replica_shares(x, y, self.num_replicas) for x, y, _ in chunk]  # per step, per replica
        last = self.num_stages - 1

        def payload(replica: int, rank: int) -> tuple[Any, Any, None]:
            inputs = [to_wire(step[replica][0]) for step in shares] if rank == 0 else None
            return inputs, [to_wire(step[replica][1]) for step in shares] if rank == last else None, None

        return self._send(shape, [lr for _, _, lr in chunk], payload)

    def _submit_positions(
        self, chunk: list[tuple[int, int, float | None]]
    ) -> tuple[int, list[tuple[int, ray.ObjectRef]], float, int]:
        """``_submit`` of steps the stages read themselves: each rank gets the positions."""
        batch, m = self.data.global_batch_size, self.num_microbatches
        check_batch(batch, m, self.num_replicas)
        shape = (batch // (self.num_replicas * m), *self._input_shape)
        positions = [(epoch, step) for epoch, step, _ in chunk]
        return self._send(shape, [lr for _, _, lr in chunk], lambda replica, rank: (None, None, positions))

    def _send(
        self, shape: tuple[int, ...], lrs: list[float | None], payload: Any
    ) -> tuple[int, list[tuple[int, ray.ObjectRef]], float, int]:
        """One ``train_steps`` call per actor for the steps of ``lrs``, with ``payload(replica,
        rank)``'s (inputs, targets, positions): (first step number, refs, when, steps)."""
        submitted = time.perf_counter()
        refs = []
        for replica in range(self.num_replicas):
            for rank in range(self.num_stages):
                inputs, targets, positions = payload(replica, rank)
                call = self.actor(rank, replica).train_steps.remote(  # the entry itself: a test's reaches the actors
                    SCHEDULES[self.schedule],
                    self.num_microbatches,
                    shape,
                    inputs,
                    targets,
                    self.clip_grad_norm,
                    lrs,
                    positions,
                )
                refs.append((global_rank(replica, rank, self.num_stages), call))
        first = self.steps_done + self._queued + 1
        self._queued += len(lrs)
        return first, refs, submitted, len(lrs)

    def _finish(self, first: int, refs: list[tuple[int, ray.ObjectRef]], submitted: float, steps: int) -> list[float]:
        """Wait for a submitted call and return its steps' losses. Its time counts from when the
        ranks could start it (its submission, or the end of the call before it when that came
        later), shared evenly by its steps."""
        results = self._gather(refs, first)  # per actor, a (loss, busy, forward busy, took) per step
        now = time.perf_counter()
        wall = (now - max(submitted, self._last_finish)) / steps
        for i in range(steps):
            self._record(
                wall,
                [actor[i][1] for actor in results],
                [actor[i][2] for actor in results],
                max(actor[i][3] for actor in results),
            )
        self._last_finish = now
        self._queued -= steps
        self.steps_done = first + steps - 1
        # Each replica's last rank returns its share of the global batch mean.
        return [sum(actor[i][0] for actor in results[self.num_stages - 1 :: self.num_stages]) for i in range(steps)]

    def predict(self, inputs: Tensor) -> Tensor:
        """Eval-mode outputs (logits) for ``inputs``, in micro-batches through replica 0's stages."""
        chunks = min(self.num_microbatches, len(inputs))
        refs = [
            (rank, self.actor(rank).infer.remote(to_wire(inputs) if rank == 0 else None, chunks))
            for rank in range(self.num_stages)
        ]
        return self._gather(refs, step=None, phase="in predict")[-1]

    def evaluate(self) -> dict[str, float]:
        """Eval-mode loss and accuracy over the val split of ``data``, every sample once, in batches
        of ``data.val_batch``: replica 0's first stage reads the images and its last stage the
        labels (``feed``); the driver gets three numbers."""
        if self.data is None:
            raise UsageError(
                "data: evaluate reads the data set given as data=StageData(...); this trainer has none (use predict)"
            )
        chunks = val_chunks(self._val_count, self.data.val_batch, self.num_microbatches)
        refs = [(rank, self.actor(rank).evaluate.remote(chunks)) for rank in range(self.num_stages)]
        loss_sum, correct, count = self._gather(refs, step=None, phase="in evaluation")[-1]
        return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_count": count}

    def reads(self) -> list[int]:
        """Per actor (replica-major), the samples it has read from ``data`` (images on a first
        stage, labels on a last one)."""
        return self._call_all("reads")

    # -- statistics ------------------------------------------------------------------------------

    def _reset_stats(self) -> None:
        self._wall = 0.0
        self._in_ranks = 0.0
        self._steps = 0
        self._busy = [0.0] * (self.num_replicas * self.num_stages)
        self._forward_busy = [0.0] * (self.num_replicas * self.num_stages)

    def _record(self, wall: float, busy: Sequence[float], forward_busy: Sequence[float], in_ranks: float) -> None:
        self._wall += wall
        self._in_ranks += in_ranks
        self._steps += 1
        self._busy = [total + seconds for total, seconds in zip(self._busy, busy)]
        self._forward_busy = [total + seconds for total, seconds in zip(self._forward_busy, forward_busy)]

    def stats(self, reset: bool = True) -> dict[str, Any]:
        """Timing of the train steps since the last reset.

        ``busy_seconds[i]``: seconds actor i (stage i % S of replica i // S) computed (forwards, backwards,
        optimizer step); ``forward_busy_seconds[i]``: of those, its forwards'.
        ``bubble_fraction``: ``1 - sum(busy) / (actors * wall_seconds)``, the share of the actors' time
        spent waiting — pipeline fill and drain, transfers, the replicas' all-reduces, Ray and driver
        overhead.
        ``rank_seconds_per_step``: the longest time a rank's step call took inside the rank, what a
        torchrun script would time; ``seconds_per_step`` minus this is the Ray call's cost.
        """
        wall = self._wall
        stats = {
            "steps": self._steps,
            "wall_seconds": wall,
            "seconds_per_step": wall / self._steps if self._steps else 0.0,
            "rank_seconds_per_step": self._in_ranks / self._steps if self._steps else 0.0,
            "busy_seconds": list(self._busy),
            "forward_busy_seconds": list(self._forward_busy),
            "bubble_fraction": 1 - sum(self._busy) / (len(self._busy) * wall) if wall > 0 else 0.0,
        }
        if reset:
            self._reset_stats()
        return stats

    # -- state -----------------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        """Set every stage's learning rate (for per-step schedules)."""
        self._call_all("set_lr", lr)

    def _replica_calls(
        self, replica: int, method: str, args_of_rank: Sequence[tuple] | None = None, phase: str | None = None
    ) -> list[Any]:
        """``method`` on each stage of ``replica`` (with ``args_of_rank[rank]``); the results in
        stage order. A failure says it happened ``phase``."""
        refs = [
            (
                global_rank(replica, rank, self.num_stages),
                getattr(self.actor(rank, replica), method).remote(*(args_of_rank[rank] if args_of_rank else ())),
            )
            for rank in range(self.num_stages)
        ]
        return self._gather(refs, step=None, phase=phase)

    def state_dict(self, replica: int = 0) -> dict[str, Tensor]:
        """The full model's state dict as ``replica`` holds it (all replicas hold the same), on the
        CPU, with the original model's keys."""
        parts = self._replica_calls(replica, "state_dict", phase="while gathering the model state")
        merged = {key: value for part in parts for key, value in part.items()}
        return {key: merged[key] for key in self._model_keys}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load a full model state dict (``strict=True`` semantics) into the stages."""
        expected = set(self._model_keys)
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise UsageError(
                f"state dict does not fit the pipeline's model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        parts = [(({key: state[key] for key in keys}),) for keys in self._stage_keys]
        for replica in range(self.num_replicas):
            self._replica_calls(replica, "load_state_dict", parts, phase="while loading the model state")

    def optimizer_state_dicts(self) -> list[dict[str, Any]]:
        """Each stage's optimizer state (CPU tensors), in stage order (replica 0's: all replicas hold
        the same, so a checkpoint does not depend on the number of replicas)."""
        return self._replica_calls(0, "optimizer_state_dict", phase="while gathering the optimizer state")

    def load_optimizer_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Load each stage's optimizer state into that stage of every replica."""
        if len(states) != self.num_stages:
            raise UsageError(f"optimizer state: {len(states)} stage states for {self.num_stages} stages")
        for replica in range(self.num_replicas):
            self._replica_calls(
                replica,
                "load_optimizer_state_dict",
                [(state,) for state in states],
                phase="while loading the optimizer state",
            )

    def _all_actors(self) -> list[Any]:
        self.actor(0)  # raises once stopped
        return self._actors

    def actor(self, stage: int, replica: int = 0) -> Any:
        """The Ray actor handle of ``stage`` of ``replica`` (for inspection and fault injection)."""
        if not self._actors:
            raise RuntimeError(f"PipelineTrainer: used after {self._stopped}; build a new PipelineTrainer")
        return self._actors[global_rank(replica, stage, self.num_stages)]

    def _stop_actors(self) -> None:
        # Dead, not only asked to die: what comes next (the next balance trial's stages, a bench's
        # torchrun peer) needs the GPUs and CPUs they held.
        stop_actors(self._actors)
        self._actors = []

    def shutdown(self) -> None:
        """Stop the stage actors and free their placement groups (safe to call twice)."""
        self._stop_actors()
        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs = []

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
