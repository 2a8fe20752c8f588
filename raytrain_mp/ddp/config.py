"""The validated ``DDPConfig`` of ``raytrain-mp ddp``: the shared training options plus DDP's own.

Pure: no Ray, no writes; ``validate()`` runs before any cluster resource is requested.
"""

from __future__ import annotations

import dataclasses

from raytrain_mp.config import TrainOptions, check, check_choice, option


DDP_PLACEMENTS = ("PACK", "SPREAD")


@dataclasses.dataclass
class DDPConfig(TrainOptions):
    num_workers: int = option(2, "Ray Train workers (DDP ranks)")
    use_gpu: bool | None = option(None, "one GPU per worker (default: when the cluster has one for each worker)")
    cpus_per_worker: int = option(1, "CPUs per worker, shared by its training process (torch threads) and its loader processes")
    loader_workers: int | None = option(None, "loader processes per worker that read and decode batches (default: --cpus-per-worker - 1; 0: read in the training process)")
    loader_prefetch: int = option(2, "batches each loader process keeps ready")
    global_batch_size: int = option(64, "samples per optimizer step over all workers")
    grad_accum_steps: int = option(1, "micro-steps accumulated per optimizer step (DDP no_sync)")
    sync_bn: bool = option(True, "synchronize BatchNorm statistics across workers")
    placement: str = option("PACK", "worker placement: PACK fills a node first, SPREAD puts one per node where it can", DDP_PLACEMENTS)

    def validate(self) -> None:
        super().validate()
        check_choice(self, "placement")
        check(self.num_workers >= 1, "num_workers", f"must be >= 1, got {self.num_workers}")
        check(self.cpus_per_worker >= 1, "cpus_per_worker", f"must be >= 1, got {self.cpus_per_worker}")
        check(self.loader_workers is None or self.loader_workers >= 0, "loader_workers", f"must be >= 0, got {self.loader_workers}")
        check(self.loader_prefetch >= 1, "loader_prefetch", f"must be >= 1, got {self.loader_prefetch}")
        check(self.global_batch_size >= 1, "global_batch_size", f"must be >= 1, got {self.global_batch_size}")
        check(self.grad_accum_steps >= 1, "grad_accum_steps", f"must be >= 1, got {self.grad_accum_steps}")
        step_batch = self.num_workers * self.grad_accum_steps
        check(
            self.global_batch_size % step_batch == 0,
            "global_batch_size",
            f"{self.global_batch_size} is not divisible by --num-workers {self.num_workers}"
            + (f" x --grad-accum-steps {self.grad_accum_steps}" if self.grad_accum_steps > 1 else "")
            + f"; accepted: a multiple of {step_batch}",
        )
        check(
            not (self.precision == "fp16" and self.use_gpu is False),
            "precision",
            "fp16 needs CUDA (GradScaler); on CPU use bf16 or fp32",
        )

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
