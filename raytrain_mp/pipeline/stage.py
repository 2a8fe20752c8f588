"""One pipeline stage: its modules, optimizer and device, driven op by op (a Ray actor's body).

Job: run the forwards and backwards the driver submits for one stage, keep the autograd state of
each micro-batch between its forward and its backward, compute the loss on the last stage, and
step its own optimizer. ``StageWorker`` is a plain class; the trainer wraps it with ``ray.remote``
(``num_gpus=1``: Ray sets ``CUDA_VISIBLE_DEVICES`` and the stage uses its single visible GPU;
otherwise ``num_cpus`` slots, and torch gets exactly that many threads rather than whatever
``OMP_NUM_THREADS`` says).

Invariants:
- Ops run in submission order (one Ray actor, one thread of execution); each forward of
  micro-batch j is followed, in the same step, by exactly one backward of j.
- The last stage's loss for micro-batch j is ``sum of cross-entropy over j * loss_scale`` with
  ``loss_scale = 1 / batch size``: accumulating these gradients equals one backward of the batch
  mean loss, and the returned values sum to the batch mean loss.
- ``step`` refuses to update when an op of the same step failed, so a half-computed gradient is
  never applied; it returns the stage's busy seconds since the previous step.
- State dicts use the original model's keys (see ``blocks.StageModule``); tensors leave the stage
  on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raytrain_mp.errors import UsageError
from raytrain_mp.optim import OPTIMIZERS, build_optimizer
from raytrain_mp.pipeline.blocks import Block
from raytrain_mp.pipeline.deferred_bn import commit_deferred_batchnorm, convert_deferred_batchnorm
from raytrain_mp.pipeline.partition import profile_blocks



@dataclass(frozen=True)
class StageConfig:
    """Everything a stage needs besides its modules."""

    index: int
    num_stages: int
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    use_gpu: bool = False
    num_cpus: int = 1
    deferred_bn: bool = False
    autocast_bf16: bool = False
    # True when a device-to-device transport (Ray RDT) carries tensors between stages; otherwise
    # activations and gradients go through host memory and the object store.
    keep_on_device: bool = False

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def check_optimizer(name: str, lr: float, momentum: float, weight_decay: float) -> None:
    if name not in OPTIMIZERS:
        raise UsageError(f"optimizer: unknown optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}")
    if not lr > 0:
        raise UsageError(f"lr: must be > 0, got {lr}")
    if momentum < 0:
        raise UsageError(f"momentum: must be >= 0, got {momentum}")
    if weight_decay < 0:
        raise UsageError(f"weight_decay: must be >= 0, got {weight_decay}")


def configure_device(use_gpu: bool, num_cpus: int) -> torch.device:
    """The device of this process: its one visible GPU, or the CPU with ``num_cpus`` threads."""
    torch.set_num_threads(max(1, int(num_cpus)))
    if use_gpu:
        torch.cuda.set_device(0)  # Ray made the stage's GPU the only visible one
        return torch.device("cuda", 0)
    return torch.device("cpu")


def profile_on_stage_device(
    model: nn.Module, blocks: list[Block], sample: Tensor, use_gpu: bool, num_cpus: int, autocast_bf16: bool
) -> list[float]:
    """``partition.profile_blocks`` on a stage's device; the body of the trainer's profiling task."""
    device = configure_device(use_gpu, num_cpus)
    return profile_blocks(model, blocks, sample, device, autocast_bf16=autocast_bf16)


R = TypeVar("R")


def _marks_failure(method: Callable[..., R]) -> Callable[..., R]:
    """Remember that an op failed, so that this step's ``step`` refuses to apply gradients."""

    @wraps(method)
    def guarded(self: StageWorker, *args: Any, **kwargs: Any) -> R:
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self._failed = True
            raise

    return guarded


class StageWorker:
    """The state and ops of one stage (wrap with ``ray.remote`` to make it an actor)."""

    def __init__(self, module: nn.Module, config: StageConfig) -> None:
        self.config = config
        self.device = configure_device(config.use_gpu, config.num_cpus)
        if config.deferred_bn:
            module = convert_deferred_batchnorm(module)
        self.module = module.to(self.device).train()
        self.dtype = next(self.module.parameters()).dtype
        check_optimizer(config.optimizer, config.lr, config.momentum, config.weight_decay)
        self.optimizer = build_optimizer(
            self.module.parameters(), config.optimizer, config.lr, config.momentum, config.weight_decay
        )
        # micro-batch index -> (input leaf or None on the first stage, output or loss to backward from)
        self._saved: dict[int, tuple[Tensor | None, Tensor]] = {}
        self._busy = 0.0
        self._failed = False

    def ready(self) -> str:
        """The stage's device, once construction has finished."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)

    @contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # count the kernels, not only their launch
        self._busy += time.perf_counter() - start

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.autocast_bf16 else nullcontext()

    def _place(self, x: Tensor) -> Tensor:
        if self.config.is_first and x.is_floating_point():
            # Only the data needs casting: later stages receive what the previous stage computed
            # (bf16 under autocast), and casting it would change the computation.
            return x.to(self.device, self.dtype)
        return x.to(self.device)

    def _send(self, x: Tensor) -> Tensor:
        return x.detach() if self.config.keep_on_device else x.detach().cpu()

    @_marks_failure
    def forward(self, index: int, x: Tensor, targets: Tensor | None = None, loss_scale: float = 1.0) -> Tensor | float:
        """Forward of micro-batch ``index``: the activation for the next stage, or (last stage) the
        micro-batch's weighted loss."""
        with self._timed():
            inp = self._place(x)
            if not self.config.is_first:
                inp.requires_grad_()  # its gradient is what the previous stage backwards from
            with self._autocast():
                out = self.module(inp)
            leaf = None if self.config.is_first else inp
            if self.config.is_last:
                # Under bf16 autocast the logits are bf16; the loss is taken in the model's dtype.
                loss = F.cross_entropy(out.to(self.dtype), targets.to(self.device), reduction="sum") * loss_scale
                self._saved[index] = (leaf, loss)
                return loss.item()
            self._saved[index] = (leaf, out)
            return self._send(out)

    @_marks_failure
    def backward(self, index: int, grad: Tensor | None = None) -> Tensor | None:
        """Backward of micro-batch ``index`` from the next stage's input gradient (none on the last
        stage); returns the gradient of this stage's input (none on the first stage)."""
        with self._timed():
            inp, out = self._saved.pop(index)
            out.backward(None if grad is None else grad.to(self.device))
            return None if inp is None else self._send(inp.grad)

    @_marks_failure
    def grad_norm_sq(self) -> float:
        """Squared L2 norm of this stage's gradients (summed over stages for global clipping)."""
        with self._timed():
            return float(sum(p.grad.double().square().sum() for p in self.module.parameters() if p.grad is not None))

    def step(self, max_norm: float | None = None, *grad_norm_sqs: float) -> float:
        """Apply the accumulated gradients; with ``max_norm``, first scale them as
        ``clip_grad_norm_`` would over all stages, whose squared norms are ``grad_norm_sqs``.
        Returns the seconds this stage computed since the previous step."""
        failed, self._failed = self._failed, False
        pending = sorted(self._saved)
        self._saved.clear()
        if failed or pending:
            self.optimizer.zero_grad(set_to_none=True)
            reason = "an op of this step failed" if failed else f"micro-batches {pending} never ran backward"
            raise RuntimeError(f"stage {self.config.index} did not step: {reason}")
        with self._timed():
            if max_norm is not None:
                total = sum(grad_norm_sqs) ** 0.5
                scale = max_norm / (total + 1e-6)  # the same epsilon as torch.nn.utils.clip_grad_norm_
                if scale < 1:
                    for p in self.module.parameters():
                        if p.grad is not None:
                            p.grad.mul_(scale)
            if self.config.deferred_bn:
                commit_deferred_batchnorm(self.module)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        busy, self._busy = self._busy, 0.0
        return busy

    @torch.no_grad()
    def infer(self, x: Tensor) -> Tensor:
        """Eval-mode forward (running BatchNorm statistics, no autograd state kept)."""
        self.module.eval()
        try:
            with self._autocast():
                out = self.module(self._place(x))
        finally:
            self.module.train()
        return out.cpu() if self.config.is_last else self._send(out)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Tensor]:
        return {key: value.detach().cpu() for key, value in self.module.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.module.load_state_dict(state, strict=True)

    def optimizer_state_dict(self) -> dict[str, Any]:
        return _to_cpu(self.optimizer.state_dict())

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        # Optimizer.load_state_dict moves the state onto each parameter's device itself.
        self.optimizer.load_state_dict(state)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {key: _to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(value) for value in obj]
    return obj
