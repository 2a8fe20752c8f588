"""What the R actors of one pipeline stage exchange after each step's schedule (data x pipeline).

Job: make the replicas of a stage leave every step with the same parameters and buffers, equal to
one process accumulating gradients over all R x m micro-batches in batch order: the gradients are
summed over the stage's data-parallel group (each replica's losses are already weighted by
1 / global batch size, so the sum is the mean gradient of the global batch), and BatchNorm
statistics are combined the way one process would have updated them. Runs inside a stage actor,
over the stage's group of a torch.distributed world (see ``replicas`` for the layout).

Invariants:
- Called by every replica of the stage in the same order with the same modules; one collective
  per kind of tensor and step (tensors are flattened into one buffer first).
- Plain BatchNorm: running statistics and ``num_batches_tracked`` equal R x m sequential
  micro-batch updates in replica order (``replicas.running_stats_weights``); ``snapshot`` must be
  taken before the schedule runs.
- ``DeferredBatchNorm``: the accumulated (count, mean, sum of squared deviations) become those of
  the whole global batch (Chan's merge over the replicas), so ``commit()`` equals one BatchNorm
  pass over it. The replicas' shares are equal, so every replica has accumulated the same count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from raytrain_mp.pipeline.deferred_bn import DeferredBatchNorm
from raytrain_mp.pipeline.replicas import running_stats_weights


def _all_reduce_in_place(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` over ``group`` with one collective per dtype."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for tensor, summed in zip(same, _unflatten_dense_tensors(flat, same)):
            tensor.copy_(summed)


def sum_gradients(modules: Sequence[nn.Module], group: dist.ProcessGroup) -> None:
    """Sum every parameter's gradient over the stage's replicas."""
    grads = [p.grad for module in modules for p in module.parameters() if p.grad is not None]
    _all_reduce_in_place(grads, group)


@dataclass
class _Snapshot:
    layer: _BatchNorm
    mean: Tensor
    var: Tensor
    tracked: int


def snapshot(modules: Sequence[nn.Module]) -> list[_Snapshot]:
    """The running statistics of every plain BatchNorm that will update them, before a step."""
    return [
        _Snapshot(layer, layer.running_mean.clone(), layer.running_var.clone(), int(layer.num_batches_tracked))
        for module in modules
        for layer in module.modules()
        if isinstance(layer, _BatchNorm)
        and not isinstance(layer, DeferredBatchNorm)
        and layer.track_running_stats
        and layer.training
    ]


@torch.no_grad()
def merge_running_stats(
    before: Sequence[_Snapshot], group: dist.ProcessGroup, num_microbatches: int, num_replicas: int, replica: int
) -> None:
    """Set the running statistics to those of all replicas' micro-batch updates in order."""
    if not before:
        return
    contributions = []
    for old in before:
        a, w, _ = running_stats_weights(old.layer.momentum, old.tracked, num_microbatches, num_replicas, replica)
        contributions += [(old.layer.running_mean - a * old.mean) * w, (old.layer.running_var - a * old.var) * w]
    _all_reduce_in_place(contributions, group)
    for old, mean, var in zip(before, contributions[0::2], contributions[1::2]):
        _, _, keep = running_stats_weights(old.layer.momentum, old.tracked, num_microbatches, num_replicas, replica)
        old.layer.running_mean.copy_(keep * old.mean + mean)
        old.layer.running_var.copy_(keep * old.var + var)
        old.layer.num_batches_tracked.fill_(old.tracked + num_microbatches * num_replicas)


@torch.no_grad()
def merge_deferred_stats(modules: Sequence[nn.Module], group: dist.ProcessGroup, num_replicas: int) -> None:
    """Make every ``DeferredBatchNorm``'s accumulated statistics those of the global batch."""
    layers = [layer for module in modules for layer in module.modules() if isinstance(layer, DeferredBatchNorm)]
    layers = [layer for layer in layers if layer._count]
    if not layers:
        return
    means = [layer._mean.clone() for layer in layers]
    totals = [mean.clone() for mean in means]
    _all_reduce_in_place(totals, group)  # equal counts: the global mean is the mean of the means
    deviations = []
    for layer, mean, total in zip(layers, means, totals):
        layer._mean.copy_(total / num_replicas)
        deviations.append(layer._m2 + (mean - layer._mean).square() * layer._count)
    _all_reduce_in_place(deviations, group)
    for layer, m2 in zip(layers, deviations):
        layer._m2.copy_(m2)
        layer._count *= num_replicas
