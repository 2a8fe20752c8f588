"""The pipeline spec: how a model is cut, scheduled, optimized and placed, validated once.

Job: ``PipelineSpec`` holds every option of ``PipelineTrainer`` besides the model, a sample batch
and the data set; ``PipelineTrainer(model, num_stages, ...)`` takes its fields as keyword
arguments (a thin layer over it), ``PipelineTrainer.from_spec`` the spec itself, and the command
line's ``PipelineConfig.pipeline_spec`` builds one. ``validate`` runs the checks that need no
cluster, in one place; ``stage_template`` is what every stage actor is given (``StageConfig``).
``check_batch`` is the one check a step runs again (a step's batch).

Pure: no Ray. Every check raises ``UsageError`` with a one-line message that starts with the
Python argument it is about; the command line says the same of its flag (``errors.OptionError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from raytrain_mp.compile_options import COMPILE_MODES
from raytrain_mp.config import MEMORY_FORMATS
from raytrain_mp.errors import OptionError, UsageError
from raytrain_mp.pipeline.microbatch import check_microbatches
from raytrain_mp.pipeline.partition import BALANCE_MODES, check_stage_count
from raytrain_mp.pipeline.replicas import check_replicas
from raytrain_mp.pipeline.schedule import check_schedule, schedule_entry
from raytrain_mp.pipeline.stage_config import StageConfig, check_optimizer


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """What ``PipelineTrainer`` builds, besides the model (see its docstring for each field)."""

    num_stages: int
    split_points: Sequence[str] | None = None
    balance: str | None = None
    schedule: str = "gpipe"
    num_microbatches: int = 4
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    norm_weight_decay: float = 0.0
    label_smoothing: float = 0.0
    ema_decay: float | None = None
    ema_steps: int = 1
    ema_warmup_epochs: float = 0.0
    use_gpu: bool | None = None
    deferred_bn: bool = False
    clip_grad_norm: float | None = None
    autocast_bf16: bool = False
    memory_format: str = "auto"
    compile: bool = False
    compile_mode: str = "default"
    compile_cache: str | None = None
    placement_strategy: str = "STRICT_PACK"
    cpus_per_stage: int = 1
    virtual_stages: int = 1
    p2p_timeout_s: float = 300.0
    num_replicas: int = 1
    balance_trials: int = 0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @property
    def parts(self) -> int:
        """Stages of the whole pipeline: ranks x virtual stages."""
        return self.num_stages * self.virtual_stages

    def check_settings(self) -> None:
        """Raise ``UsageError`` for the first bad option that needs neither the model nor a batch
        (the command line runs these too, after its own checks of its flags)."""
        if self.virtual_stages < 1:
            raise OptionError("virtual_stages", f"must be >= 1, got {self.virtual_stages}")
        layout = schedule_entry(self.schedule).layout
        check_schedule(self.schedule, self.num_stages, self.virtual_stages, self.num_microbatches, layout)
        check_optimizer(self.optimizer, self.lr, self.momentum, self.weight_decay, self.norm_weight_decay)
        if self.ema_decay is not None and not 0 <= self.ema_decay <= 1:
            raise OptionError("ema_decay", f"must be in [0, 1] (or None: no weight average), got {self.ema_decay}")
        if self.ema_steps < 1:
            raise OptionError("ema_steps", f"must be >= 1, got {self.ema_steps}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise OptionError("clip_grad_norm", f"must be > 0, got {self.clip_grad_norm}")
        if self.cpus_per_stage < 1 or int(self.cpus_per_stage) != self.cpus_per_stage:
            raise OptionError("cpus_per_stage", f"must be a whole number >= 1, got {self.cpus_per_stage}")
        if not self.p2p_timeout_s > 0:
            raise OptionError("p2p_timeout_s", f"must be > 0 seconds, got {self.p2p_timeout_s}")
        if self.memory_format not in MEMORY_FORMATS:
            accepted = ", ".join(MEMORY_FORMATS)
            raise OptionError("memory_format", f"unknown layout {self.memory_format!r}; accepted: {accepted}")
        if self.compile_mode not in COMPILE_MODES:
            accepted = ", ".join(COMPILE_MODES)
            raise OptionError("compile_mode", f"unknown mode {self.compile_mode!r}; accepted: {accepted}")
        check_replicas(self.num_replicas)

    def validate(self, model: nn.Module, num_blocks: int, sample_input: Tensor | None) -> str | None:
        """Raise ``UsageError`` for the first bad option (``model`` flattened into ``num_blocks``
        blocks); the balance mode to use: None when split points decide, else "params" or "time"."""
        self.check_settings()
        check_stage_count(num_blocks, self.parts)
        check_trainable(model)
        balance = balance_mode(self.split_points, self.balance, sample_input, self.num_microbatches)
        check_trials(balance, self.balance_trials, sample_input, self.num_microbatches, self.num_replicas)
        return balance


# The spec's fields every stage actor gets as they are.
_STAGE_FIELDS = (
    "virtual_stages",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "norm_weight_decay",
    "label_smoothing",
    "ema_decay",
    "ema_steps",
    "ema_warmup_epochs",
    "deferred_bn",
    "autocast_bf16",
    "memory_format",
    "compile",
    "compile_mode",
    "compile_cache",
    "p2p_timeout_s",
    "num_replicas",
)


def stage_template(spec: PipelineSpec, use_gpu: bool, data: object, layout: str) -> StageConfig:
    """Rank 0 of replica 0's ``StageConfig`` (the others differ in rank and replica only)."""
    shared = {name: getattr(spec, name) for name in _STAGE_FIELDS}
    return StageConfig(
        0, spec.num_stages, use_gpu=use_gpu, num_cpus=spec.cpus_per_stage, data=data, layout=layout, **shared
    )


def check_trainable(model: nn.Module) -> None:
    """Raise ``UsageError`` unless ``model`` has float32 or float64 parameters to train."""
    first = next(model.parameters(), None)
    if first is None:
        raise OptionError("model", "has no parameters to train")
    dtype = first.dtype
    if dtype not in (torch.float32, torch.float64):
        raise OptionError("model", f"parameters are {dtype}; use float32 or float64 (bf16 through autocast_bf16)")


def check_batch(batch: int, num_microbatches: int, num_replicas: int) -> None:
    """Raise ``UsageError`` unless a batch of ``batch`` samples cuts into equal micro-batches."""
    check_microbatches(num_microbatches, batch)
    if batch % num_microbatches:
        raise OptionError(
            "num_microbatches",
            f"{num_microbatches} micro-batches do not divide a batch of {batch} samples; "
            "torch's pipeline runtime needs micro-batches of equal size",
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
        raise OptionError("balance", f"unknown mode {balance!r}; accepted: {', '.join(BALANCE_MODES)}")
    if balance == "time":
        if sample_input is None:
            raise OptionError("balance", "'time' needs sample_input, a batch like the training batches, to profile on")
        check_microbatches(num_microbatches, len(sample_input))
    return balance
