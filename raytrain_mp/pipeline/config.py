"""The validated ``PipelineConfig`` of ``raytrain-mp pipeline``: the shared training options plus
the pipeline's own (stages, split, schedule, micro-batches, placement).

Pure: no Ray, no writes; ``validate()`` runs before any stage actor starts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from raytrain_mp.compile_options import CompileOptions
from raytrain_mp.config import MEMORY_FORMATS, TrainOptions, check, check_choice, option
from raytrain_mp.data.recipe_options import RecipeOptions
from raytrain_mp.errors import OptionError
from raytrain_mp.pipeline.layouts import PLACEMENT_STRATEGIES
from raytrain_mp.pipeline.schedule import SCHEDULES
from raytrain_mp.tracking_options import TrackingOptions

if TYPE_CHECKING:  # the spec loads torch; this module loads neither torch nor Ray
    from raytrain_mp.pipeline.spec import PipelineSpec

# PipelineTrainer's errors name its Python arguments (``errors.OptionError``); on the command line
# they are these flags.
FLAG_OF_ARGUMENT = {
    "num_stages": "--stages",
    "num_replicas": "--replicas",
    "split_points": "--split-points",
    "num_microbatches": "--microbatches",
    "virtual_stages": "--virtual-stages",
    "use_gpu": "--use-gpu",
    "cpus_per_stage": "--cpus-per-stage",
    "placement_strategy": "--placement",
    "clip_grad_norm": "--clip-grad-norm",
    "balance": "--balance",
    "schedule": "--schedule",
    "model": "--model",
    "data.loader_workers": "--loader-workers",
}

BALANCES = ("time", "params", "none")


@dataclasses.dataclass
class PipelineConfig(CompileOptions, TrackingOptions, RecipeOptions, TrainOptions):
    precision: str = option("fp32", "fp32 | bf16 (autocast) | fp64 (verification)", ("fp32", "bf16", "fp64"))
    stages: int = option(2, "pipeline stages, one Ray actor each")
    replicas: int = option(
        1, "data-parallel copies of the pipeline, each on its share of every batch: --replicas x --stages actors"
    )
    split_points: list | None = option(
        None,
        "cut before these modules, e.g. layer3 (the layer3 split, where the seeds cut ResNet-50); overrides --balance",
    )
    balance: str = option("time", "cut stages by measured time, parameter count, or none (= params)", BALANCES)
    balance_trials: int = option(
        0,
        "with --balance time: timed steps of the profile's cut on the stage actors, then of the cut of the profile "
        "rescaled to what each stage measured, while new (3 cuts at most); the cut that waits least stays (0: the "
        "profile decides)",
    )
    schedule: str = option("gpipe", "pipeline schedule (torch.distributed.pipelining's)", SCHEDULES)
    virtual_stages: int = option(
        1, "stages per Ray actor for the interleaved schedules: the model is cut into --stages x this"
    )
    microbatches: int = option(
        4, "micro-batches per batch (m) of each replica; --replicas x m must divide --global-batch-size"
    )
    steps_per_call: int = option(
        1,
        "optimizer steps each stage actor runs per Ray call (Keras's steps_per_execution): more shares the call's "
        "cost between steps, for models whose step takes milliseconds",
    )
    global_batch_size: int = option(64, "samples per optimizer step (all micro-batches)", aliases=("batch_size",))
    use_gpu: bool | None = option(None, "one GPU per stage (default: when the cluster has one for each stage)")
    cpus_per_stage: int = option(1, "CPUs per stage actor; also its torch thread count")
    placement: str = option("STRICT_PACK", "placement group strategy of the stages", PLACEMENT_STRATEGIES)
    deferred_bn: bool = option(False, "BatchNorm running statistics committed once per batch (torchgpipe)")
    memory_format: str = option(
        "auto",
        "layout each stage computes in: measured per stage (the faster of channels-last and contiguous), "
        "channels_last (NHWC) or contiguous; tensors between stages are contiguous either way",
        MEMORY_FORMATS,
    )
    clip_grad_norm: float | None = option(None, "clip the global gradient norm across all stages")
    loader_workers: int = option(
        0,
        "loader processes of each replica's first stage that read and decode its share of every batch on its node "
        "(0: read in the stage actor); its Ray bundle reserves a CPU for each",
    )
    loader_prefetch: int = option(2, "batches each loader process keeps ready")
    checkpoint_every_steps: int | None = option(
        None,
        "also checkpoint every this many optimizer steps, with the position in the epoch's sample order "
        "(a restart then loses at most this many steps)",
    )
    FAULTS_AT_STEPS = True  # --inject-fault also takes sSTEP: after a global step

    def validate(self) -> None:
        super().validate()
        for name in ("balance", "schedule", "placement", "memory_format"):
            check_choice(self, name)
        check(self.stages >= 1, "stages", f"must be >= 1, got {self.stages}")
        check(self.global_batch_size >= 1, "global_batch_size", f"must be >= 1, got {self.global_batch_size}")
        check(
            1 <= self.microbatches <= self.global_batch_size,
            "microbatches",
            f"must be between 1 and --global-batch-size {self.global_batch_size}, got {self.microbatches}",
        )
        check(
            self.global_batch_size % self.microbatches == 0,
            "microbatches",
            f"must divide --global-batch-size {self.global_batch_size} into equal micro-batches "
            f"(torch's pipeline runtime needs them equal), got {self.microbatches}",
        )
        check(self.replicas >= 1, "replicas", f"must be >= 1, got {self.replicas}")
        check(
            self.global_batch_size % (self.replicas * self.microbatches) == 0,
            "replicas",
            f"{self.replicas} replicas x --microbatches {self.microbatches} must divide --global-batch-size "
            f"{self.global_batch_size} into equal micro-batches, got {self.replicas}",
        )
        check(self.cpus_per_stage >= 1, "cpus_per_stage", f"must be >= 1, got {self.cpus_per_stage}")
        check(self.balance_trials >= 0, "balance_trials", f"must be >= 0, got {self.balance_trials}")
        check(
            not self.balance_trials or (self.split_points is None and self.balance == "time"),
            "balance_trials",
            f"tries the cuts of --balance time on running stages; this run cuts by "
            f"{'--split-points' if self.split_points is not None else '--balance ' + self.balance}",
        )
        check(self.steps_per_call >= 1, "steps_per_call", f"must be >= 1, got {self.steps_per_call}")
        check(self.loader_workers >= 0, "loader_workers", f"must be >= 0, got {self.loader_workers}")
        check(self.loader_prefetch >= 1, "loader_prefetch", f"must be >= 1, got {self.loader_prefetch}")
        every = self.checkpoint_every_steps
        check(every is None or every >= 1, "checkpoint_every_steps", f"must be >= 1, got {every}")
        if self.split_points is not None:
            parts = self.stages * self.virtual_stages
            check(
                len(self.split_points) == parts - 1,
                "split_points",
                f"{len(self.split_points)} split point(s) make {len(self.split_points) + 1} stages, not {parts} "
                f"(--stages {self.stages} x --virtual-stages {self.virtual_stages})",
            )
        try:  # the pipeline's own settings, as PipelineTrainer checks them
            self.pipeline_spec(self.base_lr).check_settings()
        except OptionError as exc:
            raise exc.named(FLAG_OF_ARGUMENT) from None

    def pipeline_spec(self, lr: float) -> PipelineSpec:
        """The ``PipelineTrainer`` spec of these flags, at learning rate ``lr``."""
        from raytrain_mp.ema import adjusted_decay
        from raytrain_mp.pipeline.spec import PipelineSpec

        decay = adjusted_decay(self.model_ema_decay, self.model_ema_steps, self.global_batch_size, self.epochs)
        split = self.split_points
        balance = None if split or self.balance == "none" else self.balance
        return PipelineSpec(
            num_stages=self.stages,
            split_points=split,
            balance=balance,
            schedule=self.schedule,
            num_microbatches=self.microbatches,
            optimizer=self.optimizer,
            lr=lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            norm_weight_decay=self.norm_weight_decay,
            label_smoothing=self.label_smoothing,
            ema_decay=decay if self.model_ema else None,
            ema_steps=self.model_ema_steps,
            ema_warmup_epochs=self.warmup_epochs,
            use_gpu=self.use_gpu,
            deferred_bn=self.deferred_bn,
            clip_grad_norm=self.clip_grad_norm,
            autocast_bf16=self.precision == "bf16",
            memory_format=self.memory_format,
            compile=self.compile,
            compile_mode=self.compile_mode,
            compile_cache=self.compile_cache,
            placement_strategy=self.placement,
            cpus_per_stage=self.cpus_per_stage,
            virtual_stages=self.virtual_stages,
            num_replicas=self.replicas,
            balance_trials=self.balance_trials if balance == "time" else 0,
        )
