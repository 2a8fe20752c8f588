"""The checks of ``PipelineTrainer``'s options that need no cluster: the model, the optimizer, the
batch against its micro-batches and replicas, the balance mode and the balance trials.

Pure: no Ray. Every check raises ``UsageError`` with a one-line message that starts with the
Python argument it is about.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline.layouts import MEMORY_FORMATS
from raytrain_mp.pipeline.microbatch import check_microbatches
from raytrain_mp.pipeline.partition import BALANCE_MODES
from raytrain_mp.pipeline.replicas import check_replicas
from raytrain_mp.pipeline.stage_config import check_optimizer


def check_options(
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


def check_trials(
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


def balance_mode(
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
