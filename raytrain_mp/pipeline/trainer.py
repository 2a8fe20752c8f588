"""Pipelined model-parallel training over Ray stage actors: the driver side.

Job: validate the options, cut the model into stages (``blocks`` + ``partition``), start one
``StageWorker`` actor per rank in a placement group, let the ranks form a torch.distributed process
group, and make one call per rank per step: the inputs go to rank 0 and the targets to the last
rank, once; the ranks run the schedule themselves and exchange activations and gradients point to
point (``stage``). Ray owns placement, GPU pinning, lifecycle and failure handling. The trainer
builds, submits steps and holds state; ``spec``, ``placement``, ``actors``, ``failures``,
``trials``, ``submission`` and ``stats`` do the rest.

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
- A rank that dies, raises or hangs surfaces as ``StageFailedError`` naming it and the step. When several fail, the
  origin is the one whose actor died, else the one that failed for its own reason rather than because a peer stopped
  answering (a receive times out after ``p2p_timeout_s``); when only the latter failed, the origin is a rank that
  never answered (``blame``). On NCCL a rank whose receive times out does not raise: torch's watchdog aborts its
  process. A rank whose process ended that way, or by any signal or crash, while others stay silent counts as dead
  only if they then fail within a receive timeout of the last failure (a dead rank's peers give up on it); if they
  outlive that, it lost its peer, and a silent rank is named as on gloo; telling the two apart costs up to one more
  ``p2p_timeout_s`` (and 20 s). The other ranks may be waiting on the failed one, so the trainer stops every rank of
  every replica; rebuild it (from a checkpoint) to go on.
- With replicas, a step equals gradient accumulation over all R x m micro-batches of the batch in
  order, and every replica holds the same parameters and buffers after it.
- ``state_dict()`` is the full model's state dict (original keys, CPU tensors) and loads with
  ``strict=True`` into the model the trainer was built from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from raytrain_mp.compilation import check_compiler
from raytrain_mp.data import read_meta
from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline.actors import StageActors
from raytrain_mp.pipeline.blocks import Block, StageModule, block_parameter_counts, flatten_model
from raytrain_mp.pipeline.failures import StageFailedError
from raytrain_mp.pipeline.feed import StageData, val_chunks
from raytrain_mp.pipeline.handoff import to_wire
from raytrain_mp.pipeline.layouts import PLACEMENT_STRATEGIES
from raytrain_mp.pipeline.partition import StagePlan, balance_bounds, plan_stages, split_bounds
from raytrain_mp.pipeline.placement import check_resources, node_ids, placement_groups, reserve
from raytrain_mp.pipeline.replicas import replica_shares
from raytrain_mp.pipeline.schedule import SCHEDULES, check_schedule, schedule_entry, stage_indices
from raytrain_mp.pipeline.spec import PipelineSpec, check_batch, stage_template
from raytrain_mp.pipeline.stage_config import StageConfig
from raytrain_mp.pipeline.stats import StepStats, StepTimes
from raytrain_mp.pipeline.submission import Call, Payload, StepQueue
from raytrain_mp.pipeline.trials import BalanceTrial, fastest_cut, profile, time_cut

__all__ = ["PLACEMENT_STRATEGIES", "PipelineTrainer", "StageFailedError", "check_batch", "check_resources"]


class PipelineTrainer:
    """Train ``model`` cut into stages over ``num_stages`` Ray actors (ranks) with a pipeline schedule.

    The keyword arguments are the fields of a ``spec.PipelineSpec``, validated once;
    ``PipelineTrainer.from_spec(model, spec, sample_input, data)`` takes the spec itself.

    ``virtual_stages`` V > 1 (interleaved schedules) cuts the model into ``num_stages * V`` parts and rank r holds
    parts r, r + num_stages, ...; ``split_points`` then names ``num_stages * V - 1`` cuts. Partition:
    ``split_points`` (block names to cut before, e.g. ``["layer3"]``), or ``balance`` ``"params"`` (equal parameter
    counts) or ``"time"`` (seconds profiled on one rank's device with the first micro-batch of ``sample_input``:
    equal forward+backward seconds, or for ``schedule="gpipe"`` the least largest forward plus largest backward,
    what its step pays; the cut stays when ``set_schedule`` changes the schedule). Neither means ``"params"``.
    ``balance_trials`` N > 0 (with ``"time"``) corrects the profile by the running stages: a profile times blocks
    one at a time and alone, and running stages, which share the machine, can take a few percent more or less each,
    enough to make another cut the better one. The profile's cut runs on the stage actors (one untimed step of
    ``sample_input``, N timed ones); each block's profiled seconds are scaled by what its rank measured against the
    profile (``rescale_to_measured``) and cut anew; a new cut runs in turn, up to ``TRIAL_CUTS`` cuts; the one with
    the smallest median bubble stays, built afresh. ``balance_trials`` reports every cut run, ``profile`` the
    (forward, backward) seconds of each block.
    ``memory_format`` is the layout each stage computes in: ``"channels_last"`` (NHWC, the layout
    oneDNN's CPU kernels and GPU tensor cores favour), ``"contiguous"`` (the model's own), or
    ``"auto"`` (default): each rank times each of its stages in both (compiled under ``compile``)
    on the first micro-batch of every new schedule, m or micro-batch shape, and keeps the faster
    (``memory_formats``). Tensors travel between ranks contiguous whatever the layout.
    ``compile=True`` compiles each stage in its actor (``compilation``: ``compile_mode``, the
    node's ``compile_cache``); the driver first checks that this machine compiles at all.
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

    ``num_replicas`` R: R copies of the pipeline (R x ``num_stages`` actors), each on the r-th contiguous share of
    every batch, which R x ``num_microbatches`` must divide; gradients are averaged over the replicas, so a step
    equals one over the whole batch. Each replica is one placement group under ``placement_strategy``; with
    STRICT_PACK the replicas go to different nodes where they can.
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
        norm_weight_decay: float = 0.0,
        label_smoothing: float = 0.0,
        ema_decay: float | None = None,
        ema_steps: int = 1,
        ema_warmup_epochs: float = 0.0,
        use_gpu: bool | None = None,
        deferred_bn: bool = False,
        clip_grad_norm: float | None = None,
        autocast_bf16: bool = False,
        memory_format: str = "auto",
        compile: bool = False,
        compile_mode: str = "default",
        compile_cache: str | None = None,
        placement_strategy: str = "STRICT_PACK",
        cpus_per_stage: int = 1,
        sample_input: Tensor | None = None,
        virtual_stages: int = 1,
        p2p_timeout_s: float = 300.0,
        num_replicas: int = 1,
        balance_trials: int = 0,
        data: StageData | None = None,
    ) -> None:
        arguments = locals()  # the keyword arguments are the spec's fields: a thin layer over it
        spec = PipelineSpec(**{name: arguments[name] for name in PipelineSpec.field_names()})
        self._build(model, spec, sample_input, data)

    @classmethod
    def from_spec(
        cls, model: nn.Module, spec: PipelineSpec, sample_input: Tensor | None = None, data: StageData | None = None
    ) -> PipelineTrainer:
        """The trainer of ``spec`` (``PipelineTrainer(model, **dataclasses.asdict(spec), ...)``)."""
        trainer = cls.__new__(cls)
        trainer._build(model, spec, sample_input, data)
        return trainer

    def _build(self, model: nn.Module, spec: PipelineSpec, sample_input: Tensor | None, data: StageData | None) -> None:
        # Everything that can be checked without a cluster, first.
        blocks = flatten_model(model, sample_input)
        names = [block.name for block in blocks]
        balance = spec.validate(model, len(blocks), sample_input)
        check_compiler(spec)  # compile=True: can this machine compile at all
        self.spec, parts = spec, spec.parts
        self.num_stages, self.virtual_stages = spec.num_stages, spec.virtual_stages
        self.layout = schedule_entry(spec.schedule).layout
        self.schedule, self.num_microbatches = spec.schedule, spec.num_microbatches
        self.num_replicas, self.data = spec.num_replicas, data
        if spec.ema_decay is not None and data is None:
            raise UsageError("ema_decay: the average is updated at data set positions (train_data_steps); needs data")
        if data is not None:
            meta = read_meta(data.root)
            data.check(meta)
            check_batch(data.global_batch_size, spec.num_microbatches, spec.num_replicas)
            self.steps_per_epoch = meta.counts["train"] // data.global_batch_size
            self._val_count = meta.counts["val"]
            self._input_shape = (meta.channels, *data.input_hw(meta))
        params = block_parameter_counts(model, blocks)
        bounds = split_bounds(names, spec.split_points, parts) if spec.split_points is not None else None
        if balance == "params":
            bounds = balance_bounds(params, parts)

        loaders = data.loader_workers if data is not None else 0
        use_gpu, bundles, alive = reserve(
            spec.num_stages, spec.num_replicas, spec.use_gpu, spec.cpus_per_stage, loaders, spec.placement_strategy
        )
        self.use_gpu, self.clip_grad_norm, self.p2p_timeout_s = use_gpu, spec.clip_grad_norm, spec.p2p_timeout_s
        self._times = StepTimes(spec.num_replicas * spec.num_stages)
        pgs = placement_groups(alive, bundles, spec.placement_strategy, spec.num_replicas)
        self._stages = StageActors(spec.num_stages, spec.num_replicas, use_gpu, bundles, pgs, spec.p2p_timeout_s)
        self._queue = StepQueue(self._stages, self._times)
        try:
            self._stages.wait_for_placement(spec.placement_strategy)
            # The model's own order: a stage attaches a residual block's downsample with its strided conv.
            self._model_keys = list(model.state_dict())
            template = stage_template(spec, use_gpu, data, self.layout)
            self.balance_trials: list[BalanceTrial] = []  # per cut run on the actors, the profile's first
            self.profile: list[tuple[float, float]] | None = None  # per block, (forward, backward) seconds
            seconds = forward = None
            if balance == "time":
                sample = sample_input[: -(-len(sample_input) // spec.num_microbatches)]  # the first micro-batch
                self.profile = profile(self._stages, model, blocks, sample, template)
                forward, backward = (list(phase) for phase in zip(*self.profile))
                seconds = [f + b for f, b in zip(forward, backward)]
                fill_drain = SCHEDULES[self.schedule].fill_drain
                bounds = time_cut(forward, backward, parts, fill_drain)
                if spec.balance_trials:
                    try:
                        trial = (template, bounds, forward, backward, sample_input, spec.balance_trials, fill_drain)
                        bounds, self.balance_trials = fastest_cut(self, model, blocks, *trial)
                    except StageFailedError as exc:
                        raise exc.during("in a balance trial") from exc.__cause__
            self.plan: list[StagePlan] = plan_stages(names, bounds, params, seconds, forward)
            self.start_stages(model, blocks, bounds, template)
        except BaseException:
            self.shutdown()
            raise
        self._times.reset()

    @property
    def steps_done(self) -> int:
        """Train steps completed; the CLI sets it when resuming."""
        return self._queue.steps_done

    @steps_done.setter
    def steps_done(self, steps: int) -> None:
        self._queue.steps_done = steps

    # -- setup ---------------------------------------------------------------------------------

    def start_stages(self, model: nn.Module, blocks: list[Block], bounds: Sequence[int], template: StageConfig) -> None:
        """One actor per rank of every replica, holding its parts of the cut ``bounds``, ready and in
        one process group (also each balance trial's)."""
        num_stages = self.num_stages
        pieces = [StageModule(model, blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
        held = [
            [pieces[i] for i in stage_indices(rank, num_stages, self.virtual_stages, self.layout)]
            for rank in range(num_stages)
        ]
        self._stage_keys = [[key for piece in modules for key in piece.state_dict()] for modules in held]
        self._stages.start(held, template)
        starting = "while starting"
        call_all = self._stages.call_all
        self.devices: list[str] = call_all("ready", phase=starting)  # per actor, replica-major
        self.niceness: list[int] = call_all("niceness", phase=starting)  # per actor, replica-major
        self.keeps_freed_memory: list[bool] = call_all("keeps_freed_memory", phase=starting)  # per actor
        host, port = self._stages.gather([(0, self.actor(0).host_store.remote())], step=None, phase=starting)[0]
        call_all("join_group", host, port, phase=starting)
        self.nodes: list[str] = node_ids(self._stages.pgs, num_stages)  # Ray node id per actor, replica-major

    def stop_stages(self) -> None:
        """Stop the stage actors and keep their placement groups (a balance trial's end)."""
        self._stages.stop()

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
        return self._stages.call_all("memory_formats")

    @property
    def compile_counts(self) -> list[tuple[int, int, float, str] | None]:
        """Per actor, under ``compile``: ``compilation.CompileWatch.counts`` since it started."""
        return self._stages.call_all("compile_counts")

    # -- steps -----------------------------------------------------------------------------------

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
        return self._queue.run(batches, self._submit, ahead, steps_per_call)

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
        return self._queue.run(positions, self._submit_positions, ahead, steps_per_call)

    def _submit(self, chunk: list[tuple[Tensor, Tensor, float | None]]) -> Call:
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

    def _submit_positions(self, chunk: list[tuple[int, int, float | None]]) -> Call:
        """``_submit`` of steps the stages read themselves: each rank gets the positions."""
        batch, m = self.data.global_batch_size, self.num_microbatches
        check_batch(batch, m, self.num_replicas)
        shape = (batch // (self.num_replicas * m), *self._input_shape)
        positions = [(epoch, step) for epoch, step, _ in chunk]
        return self._send(shape, [lr for _, _, lr in chunk], lambda replica, rank: (None, None, positions))

    def _send(self, shape: tuple[int, ...], lrs: list[float | None], payload: Payload) -> Call:
        return self._queue.send(
            SCHEDULES[self.schedule], self.num_microbatches, self.clip_grad_norm, shape, lrs, payload
        )

    def predict(self, inputs: Tensor) -> Tensor:
        """Eval-mode outputs (logits) for ``inputs``, in micro-batches through replica 0's stages."""
        chunks = min(self.num_microbatches, len(inputs))
        refs = [
            (rank, self.actor(rank).infer.remote(to_wire(inputs) if rank == 0 else None, chunks))
            for rank in range(self.num_stages)
        ]
        return self._stages.gather(refs, step=None, phase="in predict")[-1]

    def evaluate(self, average: bool = False) -> dict[str, float]:
        """Eval-mode loss and accuracy over the val split of ``data``, every sample once, in batches
        of ``data.val_batch``: replica 0's first stage reads the images and its last stage the
        labels (``feed``); the driver gets three numbers. ``average``: of the weight average."""
        if self.data is None:
            raise UsageError(
                "data: evaluate reads the data set given as data=StageData(...); this trainer has none (use predict)"
            )
        chunks = val_chunks(self._val_count, self.data.val_batch, self.num_microbatches)
        refs = [(rank, self.actor(rank).evaluate.remote(chunks, average)) for rank in range(self.num_stages)]
        loss_sum, correct, count = self._stages.gather(refs, step=None, phase="in evaluation")[-1]
        return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_count": count}

    def reads(self) -> list[int]:
        """Per actor (replica-major), the samples it has read from ``data`` (images on a first
        stage, labels on a last one)."""
        return self._stages.call_all("reads")

    # -- statistics ------------------------------------------------------------------------------

    def stats(self, reset: bool = True) -> StepStats:
        """Timing of the train steps since the last reset (``stats.StepStats``)."""
        stats = self._times.stats()
        if reset:
            self._times.reset()
        return stats

    # -- state -----------------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        """Set every stage's learning rate (for per-step schedules)."""
        self._stages.call_all("set_lr", lr)

    def state_dict(self, replica: int = 0, average: bool = False) -> dict[str, Tensor]:
        """The full model's state dict as ``replica`` holds it (all replicas hold the same), on the
        CPU, with the original model's keys; ``average``: the weight average's (``ema_decay``)."""
        parts = [(average,)] * self.num_stages
        parts = self._stages.replica_calls(replica, "state_dict", parts, phase="while gathering the model state")
        merged = {key: value for part in parts for key, value in part.items()}
        return {key: merged[key] for key in self._model_keys}

    def averaged(self) -> int:
        """Updates of the weight average since it last restarted (a checkpoint keeps it beside ``ema.pt``)."""
        return self._stages.replica_calls(0, "averaged", phase="while gathering the model state")[0]

    def load_state_dict(self, state: Mapping[str, Tensor], average: bool = False, averaged: int = 0) -> None:
        """Load a full model state dict (``strict=True`` semantics) into the stages; ``average``: into
        their weight averages, which continue from ``averaged`` updates."""
        expected = set(self._model_keys)
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise UsageError(
                f"state dict does not fit the pipeline's model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        parts = [({key: state[key] for key in keys}, average, averaged) for keys in self._stage_keys]
        for replica in range(self.num_replicas):
            self._stages.replica_calls(replica, "load_state_dict", parts, phase="while loading the model state")

    def optimizer_state_dicts(self) -> list[dict[str, Any]]:
        """Each stage's optimizer state (CPU tensors), in stage order (replica 0's: all replicas hold
        the same, so a checkpoint does not depend on the number of replicas)."""
        return self._stages.replica_calls(0, "optimizer_state_dict", phase="while gathering the optimizer state")

    def load_optimizer_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Load each stage's optimizer state into that stage of every replica."""
        if len(states) != self.num_stages:
            raise UsageError(f"optimizer state: {len(states)} stage states for {self.num_stages} stages")
        for replica in range(self.num_replicas):
            self._stages.replica_calls(
                replica,
                "load_optimizer_state_dict",
                [(state,) for state in states],
                phase="while loading the optimizer state",
            )

    def actor(self, stage: int, replica: int = 0) -> Any:
        """The Ray actor handle of ``stage`` of ``replica`` (for inspection and fault injection)."""
        return self._stages.actor(stage, replica)

    def shutdown(self) -> None:
        """Stop the stage actors and free their placement groups (safe to call twice)."""
        self._stages.shutdown()

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
