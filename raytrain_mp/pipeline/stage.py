"""One pipeline rank: its stage modules, optimizer and device, running whole steps (a Ray actor's body).

Job: join the stages' torch.distributed process group (gloo on CPU, NCCL on GPU), and run each
step's schedule locally with ``torch.distributed.pipelining``: the driver makes one call per rank
per step, handing the inputs to rank 0 and the targets to the last rank once (zero-copy,
``handoff``), and the ranks exchange activations and gradients point to point. ``StageWorker`` is
a plain class; the trainer wraps it with ``ray.remote`` (``num_gpus=1``: Ray sets
``CUDA_VISIBLE_DEVICES`` and the rank uses its single visible GPU; otherwise ``num_cpus`` slots,
and torch gets exactly that many threads).

A rank runs at niceness 0, where a torchrun rank runs, not at the 15 Ray gives its workers
(``niceness.run_at_normal_niceness``, where the OS allows it; ``StageWorker.niceness`` says what
it got). A CPU rank's allocator keeps the memory a step frees for the next step
(``allocator.keep_freed_memory``, glibc only; ``StageWorker.keeps_freed_memory`` says whether).

A rank computes each stage in the configured ``memory_format`` (``memory_format``:
``channels_last`` or ``contiguous``; ``auto`` times the stage in both on the first micro-batch of
every new schedule, m or shape, and takes the faster), and sends and receives contiguous tensors.
Under ``--compile`` what torch's runtime runs is each stage compiled in this actor (as torchtitan
compiles per block), and ``auto`` times the compiled stage; its eval forwards stay eager.

With ``virtual_stages`` V the model is cut into ``num_ranks * V`` stages and a rank holds the ones
``schedule.stage_indices`` gives for its ``StageConfig.layout`` (the loop: r, r + num_ranks, ...);
with V = 1 a rank holds one stage. Each step's call brings the ``schedule.Schedule`` entry itself,
which says which torch class runs it and what this module adds to it.

With ``num_replicas`` R > 1 the world holds R pipelines (``replicas`` gives the rank layout): the
schedule and the activations stay inside the replica's pipeline group, and after the schedule the
R actors of a stage sum gradients and combine BatchNorm statistics over their stage group
(``replica_sync``); clipping then takes the norm over the replica's pipeline group.

What torch's runtime does not do, and this module adds:
- Static shapes. Left to itself, ``PipelineStage`` infers activation shapes on the first step by
  running a forward and backward on uninitialized tensors, which leaves their gradients in the
  parameters and bumps a ``DeferredBatchNorm``'s sample count. Instead, whenever the schedule,
  m or the micro-batch shape changes, the ranks pass one real micro-batch through the stages in
  eval mode without autograd (``_probe``; no statistics change) and build the stages with those
  shapes, so torch's runtime never infers.
- Our loss: the last stage's loss for a micro-batch is ``sum of cross-entropy * loss_scale`` (with
  ``label_smoothing``; on labels or mixed class probabilities) with ``loss_scale = 1 / batch size`` and
  torch's ``scale_grads`` off, so accumulated gradients equal one backward of the batch mean and the
  returned losses sum to it.
- Receives posted ahead (gloo only, the entry's ``post_ahead``) and the last backward split (the
  entry's ``split_last_backward``), both in ``timed_stage.TimedStage``.
- Clipping by the global norm over all ranks (one all-reduce), deferred BatchNorm commits, and the
  optimizer step, in the same call as the schedule.
- The seconds a rank computes, which the trainer's bubble figures and time balance rest on: its
  forwards, backwards (``timed_stage``) and update, timed on its device (``busy_clock``).
- ``predict``: an eval forward over micro-batches of any size, stage to stage (``shaped_p2p``).

Invariants:
- A step either completes on every rank or raises; gradients of a failed step are dropped, never
  applied. Torch's runtime needs equal micro-batches (it sizes its receive buffers once per
  schedule); the driver checks that the batch divides.
- Every receive times out after ``p2p_timeout_s`` (the process group's timeout), so a rank whose
  peer died or hangs does not wait forever: over gloo the receive raises; over NCCL the watchdog
  aborts the whole process instead, and the trainer names the rank that went silent
  (``blame``).
- State dicts use the original model's keys (see ``blocks.StageModule``); tensors leave the rank
  on the CPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from raytrain_mp.allocator import keep_freed_memory
from raytrain_mp.compilation import CompileWatch, compiler
from raytrain_mp.memory_format import faster_layout, in_layout, layout_runner
from raytrain_mp.niceness import run_at_normal_niceness
from raytrain_mp.optim import build_optimizer
from raytrain_mp.pipeline.busy_clock import busy_clock
from raytrain_mp.pipeline.deferred_bn import commit_deferred_batchnorm, convert_deferred_batchnorm
from raytrain_mp.pipeline.feed import StageFeed
from raytrain_mp.pipeline.handoff import from_wire
from raytrain_mp.pipeline.replica_sync import merge_deferred_stats, merge_running_stats, snapshot, sum_gradients
from raytrain_mp.pipeline.replicas import pipeline_ranks, stage_ranks
from raytrain_mp.pipeline.schedule import Schedule
from raytrain_mp.pipeline.shaped_p2p import recv_shaped, send_shaped
from raytrain_mp.pipeline.stage_config import StageConfig, check_optimizer, configure_device
from raytrain_mp.pipeline.stage_state import StageState
from raytrain_mp.pipeline.timed_stage import TimedStage
from raytrain_mp.precision import Autocast, autocast_for


class StageWorker(StageState):
    """The state and steps of one rank (wrap with ``ray.remote`` to make it an actor)."""

    def __init__(self, modules: Sequence[nn.Module], config: StageConfig) -> None:
        self.config = config
        run_at_normal_niceness()  # before torch and gloo start threads of their own
        self.device = configure_device(config.use_gpu, config.num_cpus)
        self._clock = busy_clock(self.device)  # the seconds this rank computes, shared by its stages
        # On CPU each step would otherwise fault in its gradients and activations afresh.
        self._keeps_freed_memory = self.device.type == "cpu" and keep_freed_memory()
        if config.deferred_bn:
            modules = [convert_deferred_batchnorm(module) for module in modules]
        self.modules = [module.to(self.device).train() for module in modules]
        self._build_averages()  # --model-ema: an average of each stage (``stage_state``)
        # What runs a stage's forward, here and in torch's runtime: the module in its layout, under
        # autocast as configured (the state dicts stay those of self.modules). Under "auto" a stage
        # is contiguous until its first step measures it (_build_schedule).
        layout = "contiguous" if config.memory_format == "auto" else config.memory_format
        self._layouts = [layout for _ in self.modules]
        # --compile: what torch's runtime runs is each runner compiled, here, on the rank's device;
        # eval forwards (the shape probe, predict) run the runners eager: one graph a stage.
        self._compile = compiler(config)
        self._watch = CompileWatch.start() if self._compile is not None else None
        if self._compile is not None:  # torch's runtime may split a backward (input, then weight
            # gradients) over one retained graph, which a compiled backward's donated buffers forbid
            torch._functorch.config.donated_buffer = False
        self._runners = [in_layout(self._wrap(module), layout) for module in self.modules]
        self.dtype = next(p for module in self.modules for p in module.parameters()).dtype
        check_optimizer(config.optimizer, config.lr, config.momentum, config.weight_decay, config.norm_weight_decay)
        params = [p for module in self.modules for p in module.parameters()]
        decays = {"weight_decay": config.weight_decay, "norm_weight_decay": config.norm_weight_decay}
        self.optimizer = build_optimizer(params, config.optimizer, config.lr, config.momentum, **decays)
        self.holds_first = config.holder(0) == config.rank
        self.holds_last = config.holder(config.num_stages - 1) == config.rank
        reads = config.data is not None and (self.holds_first or self.holds_last)
        self._feed = (
            StageFeed(
                config.data,
                config.replica,
                config.num_replicas,
                self.device,
                self.dtype,
                self.holds_first,
                self.holds_last,
            )
            if reads
            else None
        )
        self._store: dist.TCPStore | None = None
        # With replicas: this replica's pipeline group and this stage's data-parallel group; with
        # one replica the default group is the pipeline and there is nothing to average.
        self._pipeline_group: dist.ProcessGroup | None = None
        self._stage_group: dist.ProcessGroup | None = None
        self._stages: list[TimedStage] = []
        self._schedule: Any = None
        self._schedule_key: tuple | None = None
        self._post_ahead: tuple[str, ...] = ()
        self._receives_posted_ahead = 0
        self._split_backwards = 0
        self._loss_scale = 1.0

    # -- process group ---------------------------------------------------------------------------

    def ready(self) -> str:
        """The rank's device, once construction has finished."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)

    def receives_posted_ahead(self) -> int:
        """How many of this rank's receives so far were posted at the start of their step (``Schedule.post_ahead``)."""
        return self._receives_posted_ahead

    def split_backwards(self) -> int:
        """How many backwards so far this rank ran as input gradients, sent, then weight gradients
        (``TimedStage.split_last_backward``)."""
        return self._split_backwards

    def keeps_freed_memory(self) -> bool:
        """Whether this CPU rank's allocator keeps freed memory (``allocator.keep_freed_memory``)."""
        return self._keeps_freed_memory

    def niceness(self) -> int:
        """The niceness of the thread that runs this rank's calls (0 unless the OS refused)."""
        return os.getpriority(os.PRIO_PROCESS, 0)

    def host_store(self) -> tuple[str, int]:
        """(Rank 0) start the process group's key-value store on a free port of this node; its address."""
        import ray

        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(
            host,
            0,
            self.config.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.config.p2p_timeout_s),
        )
        return host, self._store.port

    def join_group(self, host: str, port: int) -> None:
        """Join the ranks' process group through rank 0's store (every rank at once), and with
        replicas create every pipeline and stage group (all ranks create all groups, in order)."""
        config = self.config
        timeout = timedelta(seconds=config.p2p_timeout_s)
        store = self._store or dist.TCPStore(host, port, config.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            store=store,
            rank=config.peer(config.rank),
            world_size=config.world_size,
            timeout=timeout,
            **({"device_id": self.device} if self.device.type == "cuda" else {}),
        )
        if config.num_replicas == 1:
            return
        for replica in range(config.num_replicas):
            group = dist.new_group(pipeline_ranks(replica, config.num_ranks), timeout=timeout)
            self._pipeline_group = group if replica == config.replica else self._pipeline_group
        for rank in range(config.num_ranks):
            group = dist.new_group(stage_ranks(rank, config.num_replicas, config.num_ranks), timeout=timeout)
            self._stage_group = group if rank == config.rank else self._stage_group

    # -- eval forward ------------------------------------------------------------------------------

    @torch.no_grad()
    def _forward_chain(self, chunks: Sequence[Tensor] | int) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
        """Eval forward of each chunk through this rank's stages, receiving from and sending to the
        neighbouring ranks. ``chunks``: the inputs on rank 0, their number elsewhere. Returns the
        outputs (on the last rank; none elsewhere) and, per local stage, the first chunk's input and
        output (the stages' static shapes)."""
        last_stage = self.config.num_stages - 1
        count = chunks if isinstance(chunks, int) else len(chunks)
        outputs, shapes = [], []
        for module in self.modules:
            module.eval()
        try:
            for c in range(count):
                for local, runner in enumerate(self._runners):
                    index = self.config.stage_index(local)
                    previous = self.config.peer(self.config.holder(index - 1)) if index else None
                    x = self._first_input(chunks[c]) if index == 0 else recv_shaped(previous, self.device)
                    y = runner(x)
                    if c == 0:
                        shapes.append((x, y))
                    if index == last_stage:
                        outputs.append(y.to(self.dtype).cpu())
                    else:
                        send_shaped(y, self.config.peer(self.config.holder(index + 1)), self.device)
        finally:
            for module in self.modules:
                module.train()
        return outputs, shapes

    def _first_input(self, x: Tensor) -> Tensor:
        # Only the data needs casting: later stages receive what the previous stage computed (bf16
        # under autocast), and casting it would change the computation.
        return x.to(self.device, self.dtype) if x.is_floating_point() else x.to(self.device)

    def _compiled(self, local: int) -> nn.Module:
        """This rank's ``local``-th stage compiled, in its layout (``memory_format.layout_runner``)."""
        return layout_runner(self._wrap(self.modules[local]), self._layouts[local], self._compile)

    def _wrap(self, module: nn.Module) -> nn.Module:
        return Autocast(module, autocast_for("bf16", self.device)) if self.config.autocast_bf16 else module

    def compile_counts(self) -> tuple[int, int, float, str] | None:
        """Under --compile, ``CompileWatch.counts`` since this actor began (its trials included)."""
        return None if self._watch is None else self._watch.counts()

    def memory_formats(self) -> list[str]:
        """The layout each of this rank's stages computes in (``config.LAYOUTS``)."""
        return list(self._layouts)

    # -- training ----------------------------------------------------------------------------------

    def _loss(self, output: Tensor, targets: Tensor) -> Tensor:
        # Under bf16 autocast the logits are bf16; the loss is taken in the model's dtype. Targets are
        # labels, or class probabilities where the feed mixed the samples.
        smoothing = self.config.label_smoothing
        loss = F.cross_entropy(output.to(self.dtype), targets, reduction="sum", label_smoothing=smoothing)
        return loss * self._loss_scale

    def _build_schedule(self, schedule: Schedule, num_microbatches: int, probe: Tensor | None) -> Any:
        """Torch's schedule over this rank's stages (a list for the multi-stage ones), with static
        shapes from one probe micro-batch."""
        _, shapes = self._forward_chain([probe] if self.holds_first else 1)
        if self.config.memory_format == "auto":
            for local, (module, (x, _)) in enumerate(zip(self.modules, shapes)):
                layout = faster_layout(module, x, self.config.stage_index(local) > 0, self._wrap, self._compile)
                if layout != self._layouts[local]:
                    self._layouts[local], self._runners[local] = layout, in_layout(self._wrap(module), layout)
        stages = []
        for local, (runner, (x, y)) in enumerate(zip(self._runners, shapes)):
            index = self.config.stage_index(local)
            # The metadata says which tensors carry gradients: every stage's input but the data's.
            stages.append(
                TimedStage(
                    runner if self._compile is None else self._compiled(local),
                    index,
                    self.config.num_stages,
                    self.device,
                    input_args=torch.empty_like(x).requires_grad_(index > 0),
                    output_args=torch.empty_like(y).requires_grad_(),
                    group=self._pipeline_group,
                    clock=self._clock,
                )
            )
        for stage in stages:
            stage.split_last_backward = schedule.split_last_backward
        self._stages = stages
        # NCCL queues a communicator's receives and sends on one stream, where a receive posted
        # ahead would hold up the rank's own sends: GPUs post as torch does.
        self._post_ahead = schedule.post_ahead if self.device.type == "cpu" else ()
        ours = stages if schedule.multi_stage else stages[0]
        return schedule.torch_class()(ours, num_microbatches, loss_fn=self._loss, scale_grads=False)

    def train_step(
        self,
        schedule: Schedule,
        num_microbatches: int,
        microbatch_shape: tuple[int, ...],
        inputs: Tensor | None,
        targets: Tensor | None,
        max_norm: float | None = None,
        lr: float | None = None,
    ) -> tuple[float | None, float, float, float]:
        """One optimizer step: the forwards and backwards of ``schedule`` (the registry's entry) over
        the batch, clipping, the update. Rank 0 gets ``inputs``, the last rank ``targets`` (None
        elsewhere): this replica's share of the step's batch. Returns (on the last rank this replica's
        share of the global batch mean loss, else None; the seconds this rank computed; of which in
        forwards; the seconds this call took, computing and waiting for its peers). ``lr``, when
        given, is the step's learning rate (a per-step schedule sets it in the step's own call rather
        than in one more call per step)."""
        called = time.perf_counter()
        if lr is not None:
            self.set_lr(lr)
        key = (schedule, num_microbatches, tuple(microbatch_shape))
        if key != self._schedule_key:
            probe = inputs[: microbatch_shape[0]] if self.holds_first else None
            self._schedule, self._schedule_key = self._build_schedule(schedule, num_microbatches, probe), key
        replicas = self.config.num_replicas
        if self.holds_last:  # the replicas' shares are equal: this is 1 / global batch size
            self._loss_scale = 1.0 / (len(targets) * replicas)
        losses: list[Tensor] = []
        try:
            before = snapshot(self.modules) if replicas > 1 else []
            args = (self._first_input(inputs),) if self.holds_first else ()
            extra = {"target": targets.to(self.device), "losses": losses} if self.holds_last else {}
            if self._post_ahead:
                self._receives_posted_ahead += self._stages[0].post_receives(num_microbatches, self._post_ahead)
            self._schedule.step(*args, return_outputs=False, **extra)
            if replicas > 1:
                sum_gradients(self.modules, self._stage_group)
                merge_running_stats(before, self._stage_group, num_microbatches, replicas, self.config.replica)
                if self.config.deferred_bn:
                    merge_deferred_stats(self.modules, self._stage_group, replicas)
            with self._clock.region("update"):
                if max_norm is not None:
                    self._clip(max_norm)
                if self.config.deferred_bn:
                    for module in self.modules:
                        commit_deferred_batchnorm(module)
                self.optimizer.step()
        except BaseException:
            self._clock.discard()  # a failed step's regions belong to no step
            raise
        finally:
            for stage in self._stages:
                stage.drop_weight_gradients()
            self.optimizer.zero_grad(set_to_none=True)
        # Waits for this rank's last kernel (on a GPU), so the call's seconds include its compute.
        busy = self._clock.collect()
        self._split_backwards += sum(stage.split_backwards for stage in self._stages)
        for stage in self._stages:
            stage.split_backwards = 0
        loss = float(sum(loss.item() for loss in losses)) if self.holds_last else None
        return loss, sum(busy.values()), busy.get("forward", 0.0), time.perf_counter() - called

    def train_steps(
        self,
        schedule: Schedule,
        num_microbatches: int,
        microbatch_shape: tuple[int, ...],
        inputs: Sequence[np.ndarray | Tensor] | None,
        targets: Sequence[np.ndarray | Tensor] | None,
        max_norm: float | None,
        lrs: Sequence[float | None],
        positions: Sequence[tuple[int, int]] | None = None,
    ) -> list[tuple[float | None, float, float, float]]:
        """``train_step`` for each of the call's steps in order (one Ray call for several steps:
        the ranks stay in step with each other between them); ``inputs``/``targets`` hold a batch
        per step on the ranks that take them, as ``handoff.to_wire`` sent them, or ``positions``
        names each step's (epoch, step) and the first and last rank read it themselves (``feed``)."""
        results = []
        for i, lr in enumerate(lrs):
            if positions is not None:
                x, y = self._feed.batch(*positions[i]) if self._feed is not None else (None, None)
            else:
                x = from_wire(inputs[i]) if inputs is not None else None
                y = from_wire(targets[i]) if targets is not None else None
            results.append(self.train_step(schedule, num_microbatches, microbatch_shape, x, y, max_norm, lr))
            if positions is not None:
                self._update_averages(*positions[i])
        return results

    def _clip(self, max_norm: float) -> None:
        """Scale the gradients as ``clip_grad_norm_`` would over the parameters of every stage (after the
        replicas' gradients are summed, so over this replica's pipeline ranks)."""
        grads = [p.grad for module in self.modules for p in module.parameters() if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for grad in grads:
            total += grad.double().square().sum()
        dist.all_reduce(total, group=self._pipeline_group)
        scale = max_norm / (total.sqrt().item() + 1e-6)  # the same epsilon as torch.nn.utils.clip_grad_norm_
        if scale < 1:
            for grad in grads:
                grad.mul_(scale)

    def infer(self, inputs: np.ndarray | Tensor | None, num_chunks: int) -> Tensor | None:
        """Eval-mode outputs (logits) of the batch in ``num_chunks`` micro-batches: on the last rank;
        None elsewhere. Rank 0 gets ``inputs`` (as ``handoff.to_wire`` sent them)."""
        chunks = from_wire(inputs).tensor_split(num_chunks) if self.holds_first else num_chunks
        outputs, _ = self._forward_chain(chunks)
        return torch.cat(outputs) if self.holds_last else None

    def evaluate(self, chunks: Sequence[int], average: bool = False) -> tuple[float, int, int] | None:
        """Eval forward of the val split, read by the first and last rank themselves (``feed``),
        each batch in ``chunks[b]`` micro-batches, with the stages' weights or (``average``) their
        averages'. On the last rank (loss sum in float64, correct, count), as the driver's
        evaluation sums them; None elsewhere."""
        batches = self._feed.val_batches() if self._feed is not None else ((None, None) for _ in chunks)
        loss_sum, correct, count = 0.0, 0, 0
        with self._averaged_weights(average):
            for (x, y), num_chunks in zip(batches, chunks, strict=True):
                outputs, _ = self._forward_chain(x.tensor_split(num_chunks) if self.holds_first else num_chunks)
                if self.holds_last:
                    logits = torch.cat(outputs)
                    loss_sum += F.cross_entropy(logits.double(), y, reduction="sum").item()
                    correct += int((logits.argmax(dim=1) == y).sum())
                    count += len(y)
        return (loss_sum, correct, count) if self.holds_last else None

    def reads(self) -> int:
        """Samples this rank has read from the data set (``StageFeed.reads``; 0 without one)."""
        return self._feed.reads if self._feed is not None else 0
