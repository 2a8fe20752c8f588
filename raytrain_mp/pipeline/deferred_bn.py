"""BatchNorm whose running statistics are committed once per mini-batch, as torchgpipe's.

Job: in a pipeline every micro-batch passes a BatchNorm separately. Normalization per micro-batch
is what GPipe does and stays; but a plain BatchNorm would also update its running statistics once
per micro-batch, so they would depend on the number of micro-batches. ``DeferredBatchNorm``
normalizes each micro-batch with its own statistics and only accumulates the statistics of its
inputs; ``commit()`` (once per mini-batch, by the stage's optimizer step) folds them into
``running_mean``/``running_var`` exactly as one BatchNorm pass over the whole mini-batch would.

Invariants:
- Training forward output and gradients equal ``BatchNorm`` in train mode on that micro-batch.
- After ``commit()``, running statistics and ``num_batches_tracked`` equal those of one
  ``BatchNorm`` train-mode forward over the concatenated micro-batches, whatever their number
  and sizes.
- Accumulation merges per-micro-batch (count, mean, sum of squared deviations) with Chan's
  formula, never E[x^2] - E[x]^2, so it stays accurate in float32 on inputs with a large mean.
- Same parameters, buffers and state-dict keys as ``BatchNorm``; the accumulators are
  non-persistent buffers (and a Python int count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm (any dimensionality) with running statistics committed by ``commit()``."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True, device=device, dtype=dtype)
        factory = {"device": device, "dtype": dtype}
        self._count = 0  # a Python int: exact however many values pass
        self.register_buffer("_mean", torch.zeros(num_features, **factory), persistent=False)
        self.register_buffer("_m2", torch.zeros(num_features, **factory), persistent=False)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        self._accumulate(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _accumulate(self, x: Tensor) -> None:
        x = x.to(self._mean.dtype)
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.size(1)
        mean = x.mean(dims)
        m2 = (x - mean.view(1, -1, *[1] * (x.dim() - 2))).square().sum(dims)
        total = self._count + count
        delta = mean - self._mean
        self._mean += delta * (count / total)
        self._m2 += m2 + delta.square() * (self._count * count / total)
        self._count = total

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the accumulated statistics into the running ones, as one BatchNorm forward does."""
        if self._count == 0:
            return
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        # BatchNorm keeps the unbiased variance in running_var.
        unbiased = self._m2 / max(self._count - 1, 1)
        self.running_mean.mul_(1 - factor).add_(self._mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        self._count = 0
        self._mean.zero_()
        self._m2.zero_()


def convert_deferred_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every running-statistics BatchNorm in ``module`` by a ``DeferredBatchNorm``.

    The new layers take over the old parameter and buffer tensors, so build optimizers after
    converting. Returns the converted module (a new object when ``module`` itself is a BatchNorm).
    """
    if isinstance(module, _BatchNorm) and module.track_running_stats and not isinstance(module, DeferredBatchNorm):
        deferred = DeferredBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            device=module.running_mean.device,
            dtype=module.running_mean.dtype,
        )
        if module.affine:
            deferred.weight, deferred.bias = module.weight, module.bias
        deferred.running_mean, deferred.running_var = module.running_mean, module.running_var
        deferred.num_batches_tracked = module.num_batches_tracked
        deferred.train(module.training)
        return deferred
    for name, child in module.named_children():
        module.add_module(name, convert_deferred_batchnorm(child))
    return module


def commit_deferred_batchnorm(module: nn.Module) -> None:
    """Commit the statistics of every ``DeferredBatchNorm`` in ``module`` (once per mini-batch)."""
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer.commit()
