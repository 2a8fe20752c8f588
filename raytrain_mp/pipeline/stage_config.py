"""What a pipeline rank is given and where it runs: ``StageConfig``, the optimizer's check, the rank's
device, and profiling blocks on that device.

Job: the settings a stage actor gets besides its modules (its rank, replica, optimizer, device,
layout, data), the stage layout's arithmetic on them (which global rank a peer is, which stage a
local one is, who holds a stage), and the device set-up shared by the actor and the trainer's
profiling task (one visible GPU, or the CPU with exactly ``num_cpus`` torch threads).

Pure but for ``configure_device`` and ``profile_on_stage_device``, which run inside a Ray worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from raytrain_mp.allocator import keep_freed_memory
from raytrain_mp.errors import UsageError
from raytrain_mp.optim import OPTIMIZERS
from raytrain_mp.pipeline.block import Block
from raytrain_mp.pipeline.feed import StageData
from raytrain_mp.pipeline.partition import profile_blocks
from raytrain_mp.pipeline.replicas import global_rank
from raytrain_mp.pipeline.schedule import stage_indices, stage_rank


@dataclass(frozen=True)
class StageConfig:
    """Everything a rank needs besides its modules."""

    rank: int
    num_ranks: int
    virtual_stages: int = 1
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    norm_weight_decay: float = 0.0
    label_smoothing: float = 0.0  # of the last stage's loss (``F.cross_entropy``'s)
    ema_decay: float | None = None  # --model-ema: the decay of each update (``ema.adjusted_decay``); None: no average
    ema_steps: int = 1  # the average is updated after every this-many-th step of an epoch
    ema_warmup_epochs: float = 0.0  # and restarts after each update during these epochs
    use_gpu: bool = False
    num_cpus: int = 1
    deferred_bn: bool = False
    autocast_bf16: bool = False
    memory_format: str = "contiguous"  # or channels_last, or auto (config.MEMORY_FORMATS)
    compile: bool = False  # each stage compiled in this actor (``compilation``)
    compile_mode: str = "default"
    compile_cache: str | None = None  # the node's folder of compiled graphs (default: compilation's)
    p2p_timeout_s: float = 300.0
    replica: int = 0
    num_replicas: int = 1
    layout: str = "loop"  # which stages the rank holds (schedule.STAGE_LAYOUTS)
    data: StageData | None = None  # where the first and last rank read their batches (``feed``)

    @property
    def num_stages(self) -> int:
        """Stages of the whole pipeline (ranks x virtual stages)."""
        return self.num_ranks * self.virtual_stages

    @property
    def world_size(self) -> int:
        """Ranks of the process group: every stage actor of every replica."""
        return self.num_replicas * self.num_ranks

    def peer(self, rank: int) -> int:
        """The global rank of pipeline rank ``rank`` of this actor's replica."""
        return global_rank(self.replica, rank, self.num_ranks)

    def stage_index(self, local: int) -> int:
        """The pipeline index of this rank's ``local``-th stage."""
        return stage_indices(self.rank, self.num_ranks, self.virtual_stages, self.layout)[local]

    def holder(self, index: int) -> int:
        """The pipeline rank that holds stage ``index``."""
        return stage_rank(index, self.num_ranks, self.virtual_stages, self.layout)


def check_optimizer(name: str, lr: float, momentum: float, weight_decay: float, norm_weight_decay: float = 0.0) -> None:
    if name not in OPTIMIZERS:
        raise UsageError(f"optimizer: unknown optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}")
    if not lr > 0:
        raise UsageError(f"lr: must be > 0, got {lr}")
    if momentum < 0:
        raise UsageError(f"momentum: must be >= 0, got {momentum}")
    if weight_decay < 0:
        raise UsageError(f"weight_decay: must be >= 0, got {weight_decay}")
    if norm_weight_decay < 0:
        raise UsageError(f"norm_weight_decay: must be >= 0, got {norm_weight_decay}")


def configure_device(use_gpu: bool, num_cpus: int) -> torch.device:
    """The device of this process: its one visible GPU, or the CPU with ``num_cpus`` threads."""
    torch.set_num_threads(max(1, int(num_cpus)))
    if use_gpu:
        torch.cuda.set_device(0)  # Ray made the rank's GPU the only visible one
        return torch.device("cuda", 0)
    return torch.device("cpu")


def profile_on_stage_device(
    model: nn.Module,
    blocks: list[Block],
    sample: Tensor,
    use_gpu: bool,
    num_cpus: int,
    autocast_bf16: bool,
    memory_format: str = "contiguous",
) -> list[tuple[float, float]]:
    """``partition.profile_blocks`` on a rank's device; the body of the trainer's profiling task,
    whose process exits afterwards (so its allocator settings, ``keep_freed_memory``, go with it)."""
    device = configure_device(use_gpu, num_cpus)
    keep_freed_memory()
    return profile_blocks(model, blocks, sample, device, autocast_bf16=autocast_bf16, memory_format=memory_format)
