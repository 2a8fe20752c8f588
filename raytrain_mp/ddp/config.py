"""The validated ``DDPConfig`` of ``raytrain-mp ddp``: the shared training options plus DDP's own.

Pure: no Ray, no writes; ``validate()`` runs before any cluster resource is requested.
"""

from __future__ import annotations

import dataclasses

from raytrain_mp.compile_options import CompileOptions
from raytrain_mp.config import MEMORY_FORMATS, TrainOptions, check, check_choice, option
from raytrain_mp.data.recipe_options import RecipeOptions
from raytrain_mp.ddp.elastic import check_world_sizes, parse_worker_range
from raytrain_mp.tracking_options import TrackingOptions

DDP_PLACEMENTS = ("PACK", "SPREAD")


@dataclasses.dataclass
class DDPConfig(CompileOptions, TrackingOptions, RecipeOptions, TrainOptions):
    FAULTS_AT_STEPS = True  # --inject-fault also takes sSTEP: after a global step

    num_workers: int | str = option(
        2,
        "Ray Train workers (DDP ranks): a count, or MIN-MAX to train elastically (start with what the cluster has, "
        "shrink when a node is lost, grow when capacity returns; the model stays the one a fixed-size run trains)",
    )
    resize_interval: float = option(60.0, "elastic: seconds between Ray Train's checks for capacity to grow into")
    resize_timeout: float = option(
        10.0,
        "elastic: seconds a restart waits for the workers of the size it chose before it chooses again "
        "(Ray Train's worker-group start timeout, 60 s by default; a size chosen from a stale view of the nodes never "
        "fits)",
    )
    checkpoint_every_steps: int | None = option(
        None,
        "also checkpoint every this many optimizer steps, with the position in the epoch's sample order "
        "(a restart or resize then loses at most this many steps)",
    )
    use_gpu: bool | None = option(None, "one GPU per worker (default: when the cluster has one for each worker)")
    cpus_per_worker: int = option(
        1, "CPUs per worker, shared by its training process (torch threads) and its loader processes"
    )
    loader_workers: int | None = option(
        None,
        "loader processes per worker that read and decode batches (default: --cpus-per-worker - 1; 0: read in the "
        "training process)",
    )
    loader_prefetch: int = option(2, "batches each loader process keeps ready")
    global_batch_size: int = option(64, "samples per optimizer step over all workers")
    grad_accum_steps: int = option(1, "micro-steps accumulated per optimizer step (DDP no_sync)")
    sync_bn: bool = option(True, "synchronize BatchNorm statistics across workers")
    hold_at_step: str | None = option(
        None, "testing: STEP:MARKER holds every rank before global step STEP until MARKER exists", hidden=True
    )
    freeze_backbone: bool = option(
        False,
        "train the classifier head only: every backbone tensor, BatchNorm statistics included, stays as --weights has "
        "it (for small data)",
    )
    backbone_lr_scale: float = option(
        1.0, "the backbone's learning rate as a fraction of the head's (e.g. 0.1 when fine-tuning --weights)"
    )
    placement: str = option(
        "PACK", "worker placement: PACK fills a node first, SPREAD puts one per node where it can", DDP_PLACEMENTS
    )
    memory_format: str = option(
        "contiguous",
        "layout the model computes in: contiguous (NCHW, what a torchrun script runs), channels_last (NHWC), or auto: "
        "the faster of the two, timed on the first start on one micro-batch as the run computes (compiled under "
        "--compile) and kept for the whole run",
        MEMORY_FORMATS,
    )

    def validate(self) -> None:
        super().validate()
        check_choice(self, "placement")
        check_choice(self, "memory_format")
        low, high = parse_worker_range(self.num_workers)
        check(self.resize_interval > 0, "resize_interval", f"must be > 0 seconds, got {self.resize_interval}")
        check(self.resize_timeout > 0, "resize_timeout", f"must be > 0 seconds, got {self.resize_timeout}")
        check(
            self.checkpoint_every_steps is None or self.checkpoint_every_steps >= 1,
            "checkpoint_every_steps",
            f"must be >= 1, got {self.checkpoint_every_steps}",
        )
        check(
            not self.elastic or self.max_failures != 0,
            "max_failures",
            f"an elastic run (--num-workers {self.num_workers}) restarts its worker group whenever a node is lost; "
            "accepted: a number of restarts >= 1, or -1 (unlimited)",
        )
        if self.hold_at_step is not None:
            at, _, marker = self.hold_at_step.partition(":")
            check(at.isdigit() and bool(marker), "hold_at_step", "accepted: STEP:MARKER")
        check(
            self.backbone_lr_scale > 0,
            "backbone_lr_scale",
            f"must be > 0, got {self.backbone_lr_scale} (--freeze-backbone trains the head only)",
        )
        check(
            not self.freeze_backbone or self.weights is not None,
            "freeze_backbone",
            "needs --weights (a pretrained backbone to keep); accepted: with --weights, or --no-freeze-backbone",
        )
        check(self.cpus_per_worker >= 1, "cpus_per_worker", f"must be >= 1, got {self.cpus_per_worker}")
        check(
            self.loader_workers is None or self.loader_workers >= 0,
            "loader_workers",
            f"must be >= 0, got {self.loader_workers}",
        )
        check(self.loader_prefetch >= 1, "loader_prefetch", f"must be >= 1, got {self.loader_prefetch}")
        check(self.global_batch_size >= 1, "global_batch_size", f"must be >= 1, got {self.global_batch_size}")
        check(self.grad_accum_steps >= 1, "grad_accum_steps", f"must be >= 1, got {self.grad_accum_steps}")
        check_world_sizes(self.global_batch_size, self.grad_accum_steps, low, high)
        check(
            not (self.precision == "fp16" and self.use_gpu is False),
            "precision",
            "fp16 needs CUDA (GradScaler); on CPU use bf16 or fp32",
        )

    @property
    def min_workers(self) -> int:
        return parse_worker_range(self.num_workers)[0]

    @property
    def max_workers(self) -> int:
        return parse_worker_range(self.num_workers)[1]

    @property
    def elastic(self) -> bool:
        """A range of world sizes (``--num-workers MIN-MAX`` with MIN < MAX) rather than one."""
        return self.min_workers < self.max_workers

    @property
    def loaders(self) -> int:
        """Loader processes per worker: ``--loader-workers``, else all of its CPUs but one."""
        return max(0, self.cpus_per_worker - 1) if self.loader_workers is None else self.loader_workers

    @property
    def bundle_cpus(self) -> int:
        """CPUs a worker reserves: ``--cpus-per-worker``, grown so that the training process and
        each loader process have one."""
        return max(self.cpus_per_worker, self.loaders + 1)

    @property
    def torch_threads(self) -> int:
        """The training process's share of the bundle: what the loader processes leave, at least one."""
        return self.bundle_cpus - self.loaders
