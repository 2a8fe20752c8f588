"""Synchronized BatchNorm on every device torch.distributed can reach, CPU (gloo) included.

One job: under data parallelism, make each BatchNorm layer behave like one BatchNorm over the
global batch (the concatenation of every rank's batch).

Why we own it: ``torch.nn.SyncBatchNorm`` refuses CPU tensors (its forward raises, and
``DistributedDataParallel`` raises "SyncBatchNorm layers only work with GPU modules"), and this
project trains on gloo CPU workers as well as on NCCL GPUs. On CUDA, ``convert_sync_batchnorm``
still picks the native layer and its fused kernels.

Invariants:
- Training mode with a process group of world size > 1: forward output, ``running_mean``,
  ``running_var``, ``num_batches_tracked`` and the input gradient equal those of one
  ``nn.BatchNorm`` over the global batch, also when ranks hold different batch sizes (an empty rank
  included). Weight and bias gradients are this rank's share; their sum over ranks (what DDP's
  gradient all-reduce computes) is the global gradient.
- Statistics are numerically stable: each rank takes a (corrected) two-pass mean and centered sum
  of squares in the input dtype, never E[x^2]-E[x]^2, which cancels catastrophically in float32
  when |mean| >> std; ranks are merged in float64 with Chan et al.'s parallel formula.
- Every rank runs the same collectives in the same order: one all_gather per forward, one
  all_reduce per backward that needs an input gradient (none when the global batch is empty).
- Otherwise (eval mode, no process group, world size 1) it runs ``nn.BatchNorm``'s own code.
- ``torch.compile`` traces a layer whole (``compilation``): the global count is read on the host
  (a graph break) only where this rank holds fewer than two samples, the one case where the other
  ranks decide between an empty batch, one sample and a normal step.
- Parameters, buffers and state-dict keys are ``nn.BatchNorm``'s, so state dicts load either way
  with ``strict=True``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable


def _per_channel(stat: Tensor, ndim: int) -> Tensor:
    """View a (C,) statistic so that it broadcasts against an (N, C, ...) input."""
    return stat.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization whose statistics and input gradient span every rank of a group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        process_group: Any,
    ) -> Tensor:
        channels = input.shape[1]
        reduce_dims = [0, *range(2, input.dim())]
        count = input.numel() // channels
        # The 2C+1 gathered numbers are float64: counts stay exact past 2**24, and the rank means
        # keep the digits that the merge's (mean_r - mean)^2 term needs.
        if count > 0:
            # Corrected two-pass (Chan, Golub & LeVeque 1983): the second pass sums x - shift and
            # its square; the first sum repairs the rounding of the input-dtype mean, a few ulps
            # at |mean| >> std, which would otherwise leak into the merge term.
            shift = input.mean(dim=reduce_dims)
            centered = input - _per_channel(shift, input.dim())
            sum_centered = centered.sum(dim=reduce_dims).double()
            sum_squares = centered.square().sum(dim=reduce_dims).double()
            local_mean = shift.double() + sum_centered / count
            local_m2 = sum_squares - sum_centered.square() / count
        else:
            # An empty rank still joins the all_gather; its zero count removes it from the merge.
            local_mean = local_m2 = input.new_zeros(channels, dtype=torch.float64)
        local = torch.cat([torch.tensor([count], dtype=torch.float64, device=input.device), local_mean, local_m2])
        world_size = dist.get_world_size(process_group)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=process_group)
        stats = torch.stack(gathered)
        counts = stats[:, :1]
        means = stats[:, 1 : 1 + channels]
        m2s = stats[:, 1 + channels :]

        ctx.process_group = process_group
        ctx.empty = False
        if count > 1:
            # This rank alone makes the global batch larger than one: the count stays a tensor, with
            # no host sync, and torch.compile traces on (a Tensor.item() would break the graph).
            total = counts.sum()
        else:  # the other ranks decide whether the global batch is empty or a single sample
            total = int(counts.sum().item())
            if total == 1:
                raise ValueError(
                    "Expected more than 1 value per channel when training, got 1 over all ranks "
                    f"(local input size {tuple(input.shape)})"
                )
            ctx.empty = total == 0
        ctx.total = total
        if ctx.empty:
            # Like nn.BatchNorm on an empty batch: empty output, running statistics untouched.
            ctx.save_for_backward(input, weight, None, None)
            return torch.empty_like(input)

        # Chan et al. (1979), merged over k parts at once:
        # M2 = sum_r M2_r + sum_r n_r * (mean_r - mean)^2, with mean = sum_r n_r * mean_r / N.
        mean = (counts * means).sum(dim=0) / total
        m2 = m2s.sum(dim=0) + (counts * (means - mean).square()).sum(dim=0)
        invstd = torch.rsqrt(m2 / total + eps)

        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased_var = m2 / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)

        mean = mean.to(input.dtype)
        invstd = invstd.to(input.dtype)
        ctx.save_for_backward(input, weight, mean, invstd)
        out = (input - _per_channel(mean, input.dim())) * _per_channel(invstd, input.dim())
        if weight is not None:
            out = out * _per_channel(weight, input.dim())
        if bias is not None:
            out = out + _per_channel(bias, input.dim())
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        ndim = input.dim()
        reduce_dims = [0, *range(2, ndim)]
        channels = input.shape[1]

        if ctx.empty:
            grad_input = torch.zeros_like(input) if needs_input else None
            grad_weight = input.new_zeros(channels) if needs_weight else None
            grad_bias = input.new_zeros(channels) if needs_bias else None
            return grad_input, grad_weight, grad_bias, None, None, None, None, None

        xhat = (input - _per_channel(mean, ndim)) * _per_channel(invstd, ndim)
        sum_dy = grad_output.sum(dim=reduce_dims)
        sum_dy_xhat = (grad_output * xhat).sum(dim=reduce_dims)

        grad_input = None
        if needs_input:
            # d(loss)/dx depends on the batch statistics, hence on every rank's dy: sum both
            # per-channel reductions over the group before the usual BN input gradient.
            global_sums = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(global_sums, op=dist.ReduceOp.SUM, group=ctx.process_group)
            mean_dy = _per_channel(global_sums[:channels] / ctx.total, ndim)
            mean_dy_xhat = _per_channel(global_sums[channels:] / ctx.total, ndim)
            scale = invstd if weight is None else invstd * weight
            grad_input = _per_channel(scale, ndim) * (grad_output - mean_dy - xhat * mean_dy_xhat)

        # Parameter gradients stay local: DDP's gradient all-reduce adds them up across ranks.
        grad_weight = sum_dy_xhat if needs_weight else None
        grad_bias = sum_dy if needs_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class PortableSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over inputs (N, C, ...) of any rank >= 2, synchronized across a process group.

    Drop-in for ``BatchNorm1d/2d/3d`` with the same parameters, buffers and state-dict keys.
    ``process_group`` defaults to the whole world (``torch.distributed.group.WORLD``).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            device=device,
            dtype=dtype,
            bias=bias,
        )
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _sync_group(self) -> Any | None:
        """The group to synchronize over in this forward, or None to run plain BatchNorm."""
        # Eval mode uses running statistics (or, without them, each rank's own batch, as torch's
        # SyncBatchNorm does): no collective, so ranks may evaluate different numbers of batches.
        if not self.training or not dist.is_available() or not dist.is_initialized():
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: Tensor) -> Tensor:
        group = self._sync_group()
        if group is None:
            return super().forward(input)

        self._check_input_dim(input)
        # Same bookkeeping as nn.BatchNorm's forward in training mode.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group
        )


def _target_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def _to_portable(module: nn.Module, process_group: Any | None) -> nn.Module:
    converted = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, PortableSyncBatchNorm):
        converted = PortableSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            bias=module.bias is not None,
        )
        # Share, not clone, as torch's converter does: an optimizer built before conversion
        # keeps updating the live parameters, and dtype, device and requires_grad carry over.
        converted.weight = module.weight
        converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, _to_portable(child, process_group))
    return converted


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: Any | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Replace every BatchNorm in ``module`` by a synchronized one for the target device.

    The target device is ``device``, else that of the module's first parameter (or buffer), else
    CPU. On CUDA the result is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``'s; elsewhere each
    ``_BatchNorm`` (not already a ``PortableSyncBatchNorm``) becomes a ``PortableSyncBatchNorm``
    sharing its parameters and buffers. Like torch's converter this edits ``module`` in place and
    returns it, or returns a new layer when ``module`` itself is a BatchNorm. State-dict keys do not
    change.
    """
    if _target_device(module, device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _to_portable(module, process_group)
