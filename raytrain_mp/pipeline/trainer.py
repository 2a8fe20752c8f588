"""Pipelined model-parallel training over Ray stage actors: the driver side.

Job: validate the options, cut the model into stages (``blocks`` + ``partition``), start one
``StageWorker`` actor per stage in a placement group, and run each step's schedule over them by
submitting every op in clock-tick order without waiting. Activations and gradients travel as
ObjectRefs passed straight from one actor call to the next, so Ray chains them; each actor runs
its calls in submission order, which is the schedule's per-stage order.

Invariants:
- Every bad input raises ``UsageError`` before a placement group or actor exists.
- A step equals gradient accumulation over the same micro-batches in one process (each
  micro-batch's loss weighted by its share of the batch), followed by the same optimizer step.
- A stage that dies or raises surfaces as ``StageFailedError`` naming the stage and the step. The
  stage whose call failed first in submission order is the origin: every call that depends on
  another is submitted after it. After such an error the stages' state is undefined; rebuild the
  trainer (from a checkpoint) to go on.
- ``state_dict()`` is the full model's state dict (original keys, CPU tensors) and loads with
  ``strict=True`` into the model the trainer was built from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import Tensor, nn

from raytrain_mp.cluster import reachable
from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline.blocks import Block, StageModule, block_parameter_counts, flatten_model
from raytrain_mp.pipeline.microbatch import check_microbatches, split_batch
from raytrain_mp.pipeline.partition import (
    BALANCE_MODES,
    StagePlan,
    balance_bounds,
    check_stage_count,
    plan_stages,
    split_bounds,
)
from raytrain_mp.pipeline.schedule import FORWARD, build_schedule, clock_ticks
from raytrain_mp.pipeline.stage import StageConfig, StageWorker, check_optimizer, profile_on_stage_device

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
# object_store: through host memory (always works). nccl (GPU stages) and gloo (CPU stages): Ray's
# direct transport (RDT), tensors go from one stage to the next without the object store.
TRANSPORTS = ("object_store", "nccl", "gloo")
_PLACEMENT_TIMEOUT_S = 120.0


class StageFailedError(RuntimeError):
    """A stage actor died or raised; ``stage`` is its index (from 0), ``step`` the train step
    (from 1) it failed in, or None outside ``train_step``."""

    def __init__(self, stage: int, num_stages: int, step: int | None, cause: BaseException) -> None:
        self.stage, self.step = stage, step
        when = f"at step {step}" if step is not None else "outside a train step"
        super().__init__(f"pipeline stage {stage} (of stages 0-{num_stages - 1}) failed {when}: {_summary(cause)}")


def _summary(error: BaseException) -> str:
    """One line: what Ray says about a dead actor, or the exception raised inside the stage."""
    if isinstance(error, RayActorError):
        # Ray's message: a headline, indented actor details, then the reason ("killed by ray.kill").
        lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line[0].isspace()]
        return "its actor died: " + " ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else "its actor died"
    if isinstance(error, RayTaskError):
        error = error.cause  # without Ray's traceback
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else repr(error)}"


def _error_of(ref: ray.ObjectRef) -> RayError | None:
    # Reading every result of a failed step, not only the first error, also keeps Ray from
    # logging each unread error object with its traceback when it is freed.
    try:
        ray.get(ref)
    except RayError as error:
        return error
    return None


def check_resources(
    nodes: Sequence[Mapping[str, float]], num_stages: int, bundle: Mapping[str, float], strategy: str
) -> None:
    """Raise ``UsageError`` when the alive ``nodes`` (their total resources) can never hold
    ``num_stages`` copies of ``bundle`` under ``strategy``."""
    if strategy not in PLACEMENT_STRATEGIES:
        raise UsageError(
            f"placement_strategy: unknown strategy {strategy!r}; accepted: {', '.join(PLACEMENT_STRATEGIES)}"
        )
    for resource, amount in bundle.items():
        have = sum(node.get(resource, 0) for node in nodes)
        if have < num_stages * amount:
            option = "use_gpu" if resource == "GPU" else "cpus_per_stage"
            raise UsageError(
                f"{option}: {num_stages} stages need {num_stages * amount:g} {resource} "
                f"({amount:g} each); the Ray cluster has {have:g}"
            )

    def fits(node: Mapping[str, float], count: int) -> bool:
        return all(node.get(resource, 0) >= count * amount for resource, amount in bundle.items())

    if strategy == "STRICT_PACK" and not any(fits(node, num_stages) for node in nodes):
        raise UsageError(
            f"placement_strategy: STRICT_PACK needs one node that holds all {num_stages} stages "
            f"({dict(bundle)} each) and no node does; use PACK or SPREAD"
        )
    if strategy == "STRICT_SPREAD" and sum(fits(node, 1) for node in nodes) < num_stages:
        raise UsageError(
            f"placement_strategy: STRICT_SPREAD needs {num_stages} nodes that each hold one stage "
            f"({dict(bundle)}); use SPREAD or PACK"
        )


def _check_options(
    model: nn.Module, optimizer: str, lr: float, momentum: float, weight_decay: float,
    clip_grad_norm: float | None, cpus_per_stage: int, transport: str,
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
    if transport not in TRANSPORTS:
        raise UsageError(f"transport: unknown transport {transport!r}; accepted: {', '.join(TRANSPORTS)}")


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


@cache
def _stage_actor_class(device_transport: bool) -> Any:
    # Ray runs the tasks of an RDT-enabled actor on a background thread and wants the option at
    # class definition, so each transport gets its own actor class.
    if device_transport:
        return ray.remote(enable_tensor_transport=True)(StageWorker)
    return ray.remote(StageWorker)


class PipelineTrainer:
    """Train ``model`` cut into ``num_stages`` stages, one Ray actor each, with a pipeline schedule.

    Partition: ``split_points`` (block names to cut before, e.g. ``["layer3"]``), or ``balance``
    ``"params"`` (equal parameter counts) or ``"time"`` (equal forward+backward seconds, profiled
    on one stage's device with the first micro-batch of ``sample_input``). Neither means
    ``"params"``. ``use_gpu=None`` uses GPUs when the Ray cluster has any. ``transport="nccl"``
    (GPU stages) or ``"gloo"`` (CPU stages) sends activations and gradients straight from stage to
    stage with Ray's direct transport (RDT); ``"object_store"`` goes through host memory.

    The model itself is left untouched: every stage works on a copy. When Ray is not initialized
    yet, joins ``RAY_ADDRESS`` if set (one error line if nothing answers there) and otherwise
    starts a new local Ray instance, whatever a stale ``ray start`` left behind. Stage indices count from 0, steps from 1.
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
        placement_strategy: str = "STRICT_PACK",
        cpus_per_stage: int = 1,
        sample_input: Tensor | None = None,
        transport: str = "object_store",
    ) -> None:
        # Everything that can be checked without a cluster, first.
        blocks = flatten_model(model)
        names = [block.name for block in blocks]
        check_stage_count(len(blocks), num_stages)
        self.num_stages = num_stages
        self.set_schedule(schedule, num_microbatches)
        _check_options(model, optimizer, lr, momentum, weight_decay, clip_grad_norm, cpus_per_stage, transport)
        balance = _balance_mode(split_points, balance, sample_input, num_microbatches)
        params = block_parameter_counts(model, blocks)
        bounds = split_bounds(names, split_points, num_stages) if split_points is not None else None
        if balance == "params":
            bounds = balance_bounds(params, num_stages)

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=reachable(address, "RAY_ADDRESS") if address else "local")
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        if use_gpu is None:
            use_gpu = sum(node.get("GPU", 0) for node in nodes) > 0
        if transport == "nccl" and not use_gpu:
            raise UsageError("transport: 'nccl' moves tensors between GPUs; it needs use_gpu")
        if transport == "gloo" and use_gpu:
            raise UsageError("transport: 'gloo' moves CPU tensors; GPU stages use 'nccl' or 'object_store'")
        bundle = {"CPU": cpus_per_stage, **({"GPU": 1} if use_gpu else {})}
        check_resources(nodes, num_stages, bundle, placement_strategy)

        self.use_gpu = use_gpu
        self.clip_grad_norm = clip_grad_norm
        self.steps_done = 0  # train steps completed; the CLI sets it when resuming
        self._transport = transport
        self._rdt = transport != "object_store"
        self._actors: list[Any] = []
        self._pg = placement_group([dict(bundle) for _ in range(num_stages)], strategy=placement_strategy)
        try:
            self._wait_for_placement(bundle, placement_strategy)
            seconds = None
            if balance == "time":
                sample = split_batch(sample_input, None, num_microbatches)[0].inputs
                seconds = self._profile(model, blocks, sample, cpus_per_stage, autocast_bf16)
                bounds = balance_bounds(seconds, num_stages)
            self.plan: list[StagePlan] = plan_stages(names, bounds, params, seconds)
            stage_modules = [StageModule(model, blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
            self._stage_keys = [list(module.state_dict()) for module in stage_modules]
            actor_class = _stage_actor_class(self._rdt)
            for index, module in enumerate(stage_modules):
                config = StageConfig(
                    index=index, num_stages=num_stages, optimizer=optimizer, lr=lr, momentum=momentum,
                    weight_decay=weight_decay, use_gpu=use_gpu, num_cpus=cpus_per_stage,
                    deferred_bn=deferred_bn, autocast_bf16=autocast_bf16, keep_on_device=self._rdt,
                )
                options = self._placement(index, cpus_per_stage)
                self._actors.append(actor_class.options(**options).remote(module, config))
            self.devices: list[str] = self._call_all("ready")
            bundle_nodes = ray.util.placement_group_table(self._pg)["bundles_to_node_id"]
            self.nodes: list[str] = [bundle_nodes[index] for index in range(num_stages)]  # Ray node id per stage
            if self._rdt:
                from ray.experimental.collective import create_collective_group

                create_collective_group(self._actors, backend=transport)
        except BaseException:
            self.shutdown()
            raise
        self._reset_stats()

    # -- setup ---------------------------------------------------------------------------------

    def _placement(self, index: int, cpus: int) -> dict[str, Any]:
        return {
            "num_cpus": cpus,
            "num_gpus": 1 if self.use_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=index),
        }

    def _wait_for_placement(self, bundle: Mapping[str, float], strategy: str) -> None:
        ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"placement group of {self.num_stages} x {dict(bundle)} ({strategy}) was not ready after "
                f"{_PLACEMENT_TIMEOUT_S:g} s; other jobs may hold the resources"
            )

    def _profile(
        self, model: nn.Module, blocks: list[Block], sample: Tensor, cpus: int, autocast_bf16: bool
    ) -> list[float]:
        # Profile where stage 0 will run, before its actor takes the bundle: the target device.
        task = ray.remote(profile_on_stage_device).options(**self._placement(0, cpus))
        return ray.get(task.remote(model, blocks, sample, self.use_gpu, cpus, autocast_bf16))

    def set_schedule(self, schedule: str | None = None, num_microbatches: int | None = None) -> None:
        """Change the schedule and/or the number of micro-batches for the next steps; the stages,
        their parameters and optimizer state stay (a benchmark sweeps m without restarting)."""
        schedule = self.schedule if schedule is None else schedule
        num_microbatches = self.num_microbatches if num_microbatches is None else num_microbatches
        self._ticks = clock_ticks(build_schedule(schedule, self.num_stages, num_microbatches))
        self.schedule, self.num_microbatches = schedule, num_microbatches

    # -- running ops -----------------------------------------------------------------------------

    def _call(self, stage: int, method: str, *args: Any, tensor_out: bool = False) -> ray.ObjectRef:
        bound = getattr(self.actor(stage), method)
        if tensor_out and self._rdt:
            bound = bound.options(tensor_transport=self._transport)
        return bound.remote(*args)

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        refs = [(stage, self._call(stage, method, *args)) for stage in range(self.num_stages)]
        return self._gather(refs, [ref for _, ref in refs], step=None)

    def _gather(
        self, submitted: list[tuple[int, ray.ObjectRef]], wanted: list[ray.ObjectRef], step: int | None
    ) -> list[Any]:
        """``ray.get(wanted)``, turning a failure into ``StageFailedError`` for its origin stage."""
        try:
            return ray.get(wanted)
        except RayError:
            failures = [(stage, error) for stage, ref in submitted if (error := _error_of(ref)) is not None]
            if not failures:
                raise
            stage, origin = failures[0]
            raise StageFailedError(stage, self.num_stages, step, origin) from origin

    def train_step(self, inputs: Tensor, targets: Tensor) -> float:
        """One optimizer step on the batch; returns the batch mean cross-entropy loss."""
        microbatches = split_batch(inputs, targets, self.num_microbatches)
        step = self.steps_done + 1
        last = self.num_stages - 1
        loss_scale = 1.0 / len(inputs)
        start = time.perf_counter()
        outputs: dict[tuple[int, int], ray.ObjectRef] = {}  # (stage, micro-batch) -> activation
        grads: dict[tuple[int, int], ray.ObjectRef] = {}  # (stage, micro-batch) -> input gradient
        submitted: list[tuple[int, ray.ObjectRef]] = []
        losses = []
        for tick in self._ticks:
            for stage, (kind, j) in tick:
                if kind == FORWARD:
                    x = microbatches[j].inputs if stage == 0 else outputs[stage - 1, j]
                    if stage == last:
                        ref = self._call(stage, "forward", j, x, microbatches[j].targets, loss_scale)
                        losses.append(ref)
                    else:
                        ref = outputs[stage, j] = self._call(stage, "forward", j, x, tensor_out=True)
                else:
                    grad = grads[stage + 1, j] if stage < last else None
                    ref = grads[stage, j] = self._call(stage, "backward", j, grad, tensor_out=stage > 0)
                submitted.append((stage, ref))
        norms = []
        if self.clip_grad_norm is not None:
            norms = [self._call(stage, "grad_norm_sq") for stage in range(self.num_stages)]
            submitted += list(enumerate(norms))
        steps = [self._call(stage, "step", self.clip_grad_norm, *norms) for stage in range(self.num_stages)]
        submitted += list(enumerate(steps))
        values = self._gather(submitted, losses + steps, step)
        self._record(time.perf_counter() - start, values[len(losses):])
        self.steps_done = step
        return float(sum(values[: len(losses)]))

    def predict(self, inputs: Tensor) -> Tensor:
        """Eval-mode outputs (logits) for ``inputs``, micro-batched through the stages."""
        chunks = split_batch(inputs, None, min(self.num_microbatches, len(inputs)))
        submitted, outputs = [], []
        for chunk in chunks:
            ref = chunk.inputs
            for stage in range(self.num_stages):
                ref = self._call(stage, "infer", ref, tensor_out=stage < self.num_stages - 1)
                submitted.append((stage, ref))
            outputs.append(ref)
        return torch.cat(self._gather(submitted, outputs, step=None))

    # -- statistics ------------------------------------------------------------------------------

    def _reset_stats(self) -> None:
        self._wall = 0.0
        self._steps = 0
        self._busy = [0.0] * self.num_stages

    def _record(self, wall: float, busy: Sequence[float]) -> None:
        self._wall += wall
        self._steps += 1
        self._busy = [total + seconds for total, seconds in zip(self._busy, busy)]

    def stats(self, reset: bool = True) -> dict[str, Any]:
        """Timing of the train steps since the last reset.

        ``busy_seconds[s]``: seconds stage s computed (forwards, backwards, optimizer step).
        ``bubble_fraction``: ``1 - sum(busy) / (num_stages * wall_seconds)``, the share of the
        stages' time spent waiting — pipeline fill and drain, transfers, Ray and driver overhead.
        """
        wall = self._wall
        stats = {
            "steps": self._steps,
            "wall_seconds": wall,
            "seconds_per_step": wall / self._steps if self._steps else 0.0,
            "busy_seconds": list(self._busy),
            "bubble_fraction": 1 - sum(self._busy) / (self.num_stages * wall) if wall > 0 else 0.0,
        }
        if reset:
            self._reset_stats()
        return stats

    # -- state -----------------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        """Set every stage's learning rate (for per-step schedules)."""
        self._call_all("set_lr", lr)

    def state_dict(self) -> dict[str, Tensor]:
        """The full model's state dict, on the CPU, with the original model's keys."""
        return {key: value for part in self._call_all("state_dict") for key, value in part.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load a full model state dict (``strict=True`` semantics) into the stages."""
        expected = {key for keys in self._stage_keys for key in keys}
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise UsageError(
                f"state dict does not fit the pipeline's model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        parts = [{key: state[key] for key in keys} for keys in self._stage_keys]
        refs = [(stage, self._call(stage, "load_state_dict", part)) for stage, part in enumerate(parts)]
        self._gather(refs, [ref for _, ref in refs], step=None)

    def optimizer_state_dicts(self) -> list[dict[str, Any]]:
        """Each stage's optimizer state (CPU tensors), in stage order."""
        return self._call_all("optimizer_state_dict")

    def load_optimizer_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        if len(states) != self.num_stages:
            raise UsageError(f"optimizer state: {len(states)} stage states for {self.num_stages} stages")
        refs = [(stage, self._call(stage, "load_optimizer_state_dict", state)) for stage, state in enumerate(states)]
        self._gather(refs, [ref for _, ref in refs], step=None)

    def actor(self, stage: int) -> Any:
        """The Ray actor handle of ``stage`` (for inspection and fault injection)."""
        if not self._actors:
            raise RuntimeError("PipelineTrainer: used after shutdown(), which stopped its stage actors; build a new PipelineTrainer")
        return self._actors[stage]

    def shutdown(self) -> None:
        """Stop the stage actors and free their placement group (safe to call twice)."""
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
