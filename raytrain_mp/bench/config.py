"""The validated configs of ``raytrain-mp bench ddp``, ``bench pipeline`` and ``bench data``.

Pure: no torch, no Ray, no writes (``--help`` builds its parser from these without importing
torch); ``validate()`` runs before any process or actor starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raytrain_mp.compile_options import COMPILE_MODES
from raytrain_mp.config import MEMORY_FORMATS, check, check_choice, check_local, check_writable, option
from raytrain_mp.data.augment import POLICIES
from raytrain_mp.models import MODEL_HELP, RESNET_NAMES, check_model_syntax
from raytrain_mp.pipeline.schedule import SCHEDULES

LAYER3_SPLIT = ("layer3",)


def check_shared(cfg: Any) -> None:
    """The checks of the options both benchmarks have: model (its name: whether it builds and
    takes the images is ``models.check_model``'s, before anything runs), output folder, input, timing."""
    check_model_syntax(cfg.model)
    check(bool(cfg.out), "out", "an output folder is required")
    check_local("out", cfg.out, "a local folder (results.json and PNG plots are written there atomically)")
    check_writable("out", cfg.out)
    check(cfg.image_size >= 8, "image_size", f"must be >= 8, got {cfg.image_size}")
    check(cfg.num_classes >= 2, "num_classes", f"must be >= 2, got {cfg.num_classes}")
    check(cfg.steps >= 1, "steps", f"must be >= 1, got {cfg.steps}")
    check(cfg.warmup >= 0, "warmup", f"must be >= 0, got {cfg.warmup}")


@dataclasses.dataclass
class BenchDDPConfig:
    out: str = option("", "folder for results.json and the plot")
    model: str = option("resnet18", f"model: {MODEL_HELP}")
    image_size: int = option(32, "side of the random square input images in pixels")
    small_stem: bool | None = option(
        None, "ResNets: 3x3 stride-1 stem without max-pool (default: on below 64 px, as raytrain-mp ddp)"
    )
    batch_size_per_worker: int = option(32, "samples per worker per step", aliases=("batch_size",))
    num_classes: int = option(10, "classes of the random labels")
    num_workers: tuple[int, ...] = option((1, 2), "worker counts to measure (DDP ranks)", aliases=("workers",))
    cpus_per_worker: int = option(1, "CPUs per worker; also its torch thread count", aliases=("threads",))
    use_gpu: bool | None = option(
        None,
        "one GPU per worker on both sides, the reference on one, and nn.DataParallel over 2+ "
        "(default: when this machine has a GPU for each worker of the largest count)",
    )
    sync_bn: bool = option(False, "synchronized BatchNorm (as raytrain-mp ddp) on both sides; off: plain BatchNorm")
    bucket_cap_mb: float = option(25.0, "DDP gradient bucket size in MiB (torch's default 25)")
    compile: bool = option(
        False,
        "also measure both sides compiled: ours as raytrain-mp ddp --compile runs it (the model compiled, DDP over "
        "it), torchrun's as a script does (torch.compile(DDP(model))); each from an empty compile cache, and ours "
        "again from the cache it filled (the first step of a restart)",
        group="benchmark",
    )
    compile_mode: str = option("default", "--compile: torch.compile's mode", COMPILE_MODES, group="benchmark")
    rounds: int = option(
        1,
        "rounds of every side in turn (torchrun's, then Ray Train's), each side's steps pooled: a shared machine's "
        "drift then hits both alike",
        group="benchmark",
    )
    steps: int = option(40, "timed steps per figure")
    warmup: int = option(10, "untimed steps before them")
    lr: float = option(0.01, "SGD learning rate")
    seed: int = option(0, "seed of the model and the random data")
    address: str | None = option(None, "Ray cluster address (default: RAY_ADDRESS, else a new local Ray)")
    verbose: bool = option(False, "also show Ray's informational log lines (they are always in Ray's log files)")
    json: bool = False

    def validate(self) -> None:
        check_shared(self)
        check(
            self.batch_size_per_worker >= 1, "batch_size_per_worker", f"must be >= 1, got {self.batch_size_per_worker}"
        )
        check(
            len(self.num_workers) >= 1 and min(self.num_workers) >= 1,
            "num_workers",
            f"each count must be >= 1, got {list(self.num_workers)}",
        )
        check(self.cpus_per_worker >= 1, "cpus_per_worker", f"must be >= 1, got {self.cpus_per_worker}")
        check(self.bucket_cap_mb > 0, "bucket_cap_mb", f"must be > 0, got {self.bucket_cap_mb}")
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(self.rounds >= 1, "rounds", f"must be >= 1, got {self.rounds}")
        check_choice(self, "compile_mode")
        check(self.compile or self.compile_mode == "default", "compile_mode", "needs --compile")

    def settings(self, compiled: str | None = None, cache: str | None = None) -> dict[str, Any]:
        """What a worker needs (plain values: it travels as JSON to torchrun and to Ray workers);
        ``compiled``: None (eager), "ours" or "torch" (``bench.ddp.distributed``), with its ``cache``."""
        plain = {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("out", "address", "json", "num_workers", "verbose", "compile", "rounds")
        }
        return {**plain, "compiled": compiled, "compile_cache": cache}


@dataclasses.dataclass
class BenchPipelineConfig:
    out: str = option("", "folder for results.json and the plots")
    # The layer3 split and the native peer's stage modules are ResNet layers: ResNets only.
    model: str = option(
        "resnet50",
        "model: a torchvision ResNet (the layer3 split: cut before layer3, where the seeds cut ResNet-50)",
        RESNET_NAMES,
    )
    image_size: int = option(128, "side of the random square input images in pixels")
    global_batch_size: int = option(64, "samples per training step", aliases=("batch_size",))
    num_classes: int = option(1000, "classes of the random labels (the seeds' ResNet-50 has 1000)")
    stages: int = option(2, "pipeline stages, one Ray actor each (and one torchrun rank each for the native peer)")
    cpus_per_stage: int = option(1, "CPUs per stage actor and per native rank; also their torch thread count")
    use_gpu: bool | None = option(
        None,
        "one GPU per stage actor and per native rank, and the reference on one (default: when this machine has a GPU "
        "for each stage)",
    )
    threads: int = option(2, "torch threads of the one-process baseline (default: the stages' CPUs together)")
    microbatches: tuple[int, ...] = option(
        (2, 4, 8),
        "micro-batch counts m to sweep: ours on both layouts, native, grad accumulation (naive model parallel, "
        "m=1 on the layer3 split, is always run; 1F1B needs m >= --stages)",
    )
    memory_format: str = option(
        "auto",
        "layout our stages compute in (PipelineTrainer's memory_format: auto measures each stage in both); "
        "unless contiguous, the native peer also runs the layer3 split in the layouts ours chose "
        "(results['native_ours_layouts'])",
        MEMORY_FORMATS,
    )
    split_points: tuple[str, ...] = option(LAYER3_SPLIT, "the fixed split: cut before these modules (the layer3 split)")
    balanced: bool = option(True, "also run time-balanced stages (GPipe only)")
    interleaved: bool = option(True, "also run time-balanced stages, 2 per actor, with interleaved 1F1B")
    balance_microbatches: int = option(8, "balanced stages are profiled on a micro-batch of global-batch-size / this")
    balance_trials: int = option(
        3,
        "balanced stages: timed steps (at m = --balance-microbatches) of each cut run before the timed figures: the "
        "profile's, then the profile rescaled to what each stage measured, cut anew (PipelineTrainer's "
        "balance_trials; 0: the profile decides)",
    )
    compile: bool = option(
        False,
        "layer3 split: each stage compiled on both sides (ours: PipelineTrainer's compile; torch's runtime: the same "
        "stage modules, torch.compile'd in their ranks)",
        group="benchmark",
    )
    steps: int = option(3, "timed steps per figure (and round, on the layer3 split)")
    warmup: int = option(1, "untimed steps before each figure")
    resnet_rounds: int = option(
        3,
        "rounds of ours then native on the layer3 split, pooled (drift of a shared machine's speed then hits both "
        "alike)",
    )
    seed: int = option(0, "seed of the model and the random batch")
    overhead: bool = option(
        True,
        "also time the overhead-bound case: a tiny MLP whose compute is negligible, ours vs native",
        group="benchmark",
    )
    overhead_batch_size: int = option(64, "overhead case: samples per step of the MLP", group="benchmark")
    overhead_microbatches: tuple[int, ...] = option(
        (2, 4, 8, 16), "overhead case: the m values to sweep", group="benchmark"
    )
    overhead_schedules: tuple[str, ...] = option(
        tuple(SCHEDULES),
        f"overhead case: schedules to sweep (interleaved ones with 2 stages per actor), of {', '.join(SCHEDULES)}",
        group="benchmark",
    )
    overhead_steps: int = option(
        40, "overhead case: timed steps per figure and round (after a few untimed ones)", group="benchmark"
    )
    overhead_steps_per_call: int = option(
        8,
        "overhead case: steps per Ray call when the steps are queued as the run loop queues them (pipeline "
        "--steps-per-call)",
        group="benchmark",
    )
    overhead_rounds: int = option(
        3,
        "overhead case: rounds of ours then native, pooled (drift of a shared machine's speed then hits both alike)",
        group="benchmark",
    )
    hybrid: bool = option(
        True, "also time data x pipeline layouts of --hybrid-workers actors: --replicas R x --stages S = k"
    )
    hybrid_workers: int = option(
        2, "hybrid case: stage actors k of every layout (R=k S=1 data parallel ... R=1 S=k pipeline)"
    )
    hybrid_microbatches: int = option(4, "hybrid case: micro-batches of a whole step (R x m), the same in every layout")
    address: str | None = option(None, "Ray cluster address (default: RAY_ADDRESS, else a new local Ray)")
    verbose: bool = option(False, "also show Ray's informational log lines (they are always in Ray's log files)")
    json: bool = False

    def validate(self) -> None:
        check_shared(self)
        check_choice(self, "model")
        check(self.global_batch_size >= 1, "global_batch_size", f"must be >= 1, got {self.global_batch_size}")
        check(self.stages >= 2, "stages", f"a pipeline needs at least 2 stages, got {self.stages}")
        check_choice(self, "memory_format")
        check(self.cpus_per_stage >= 1, "cpus_per_stage", f"must be >= 1, got {self.cpus_per_stage}")
        check(self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")
        check(len(self.microbatches) >= 1, "microbatches", "give at least one m, e.g. 1,2,4,8")
        bad = [m for m in self.microbatches if not 1 <= m <= self.global_batch_size]
        check(
            not bad,
            "microbatches",
            f"each m must be between 1 and --global-batch-size {self.global_batch_size}, got {bad}",
        )
        check(
            len(self.split_points) == self.stages - 1,
            "split_points",
            f"{len(self.split_points)} split point(s) make {len(self.split_points) + 1} stages, not --stages "
            f"{self.stages}",
        )
        check(
            1 <= self.balance_microbatches <= self.global_batch_size,
            "balance_microbatches",
            f"must be between 1 and --global-batch-size {self.global_batch_size}, got {self.balance_microbatches}",
        )
        check(self.overhead_batch_size >= 1, "overhead_batch_size", f"must be >= 1, got {self.overhead_batch_size}")
        check(len(self.overhead_microbatches) >= 1, "overhead_microbatches", "give at least one m, e.g. 2,4,8,16")
        bad = [m for m in self.overhead_microbatches if not 1 <= m <= self.overhead_batch_size]
        check(
            not bad,
            "overhead_microbatches",
            f"each m must be between 1 and --overhead-batch-size {self.overhead_batch_size}, got {bad}",
        )
        check(self.overhead_steps >= 1, "overhead_steps", f"must be >= 1, got {self.overhead_steps}")
        check(
            self.overhead_steps_per_call >= 1,
            "overhead_steps_per_call",
            f"must be >= 1, got {self.overhead_steps_per_call}",
        )
        check(self.balance_trials >= 0, "balance_trials", f"must be >= 0, got {self.balance_trials}")
        check(
            not self.balance_trials or self.global_batch_size % self.balance_microbatches == 0,
            "balance_microbatches",
            f"must divide --global-batch-size {self.global_batch_size} for --balance-trials' steps, got "
            f"{self.balance_microbatches}",
        )
        check(self.resnet_rounds >= 1, "resnet_rounds", f"must be >= 1, got {self.resnet_rounds}")
        check(self.overhead_rounds >= 1, "overhead_rounds", f"must be >= 1, got {self.overhead_rounds}")
        check(self.hybrid_workers >= 1, "hybrid_workers", f"must be >= 1, got {self.hybrid_workers}")
        check(
            self.hybrid_microbatches % self.hybrid_workers == 0
            and self.global_batch_size % self.hybrid_microbatches == 0,
            "hybrid_microbatches",
            f"must be a multiple of --hybrid-workers {self.hybrid_workers} that divides --global-batch-size "
            f"{self.global_batch_size}, got {self.hybrid_microbatches}",
        )
        check(len(self.overhead_schedules) >= 1, "overhead_schedules", f"give at least one of {', '.join(SCHEDULES)}")
        unknown = [s for s in self.overhead_schedules if s not in SCHEDULES]
        check(not unknown, "overhead_schedules", f"unknown schedule(s) {unknown}; accepted: {', '.join(SCHEDULES)}")

    @property
    def sweep(self) -> list[int]:
        """The m values run: the requested ones and always m=1 (naive model parallel)."""
        return sorted(set(self.microbatches) | {1})


DATA_LOADER_CASES = ("raw_32", "raw_224", "encoded_jpeg_224")
DATA_PIPELINE_CASE = "pipeline_input_jpeg_224"
DATA_CASES = (*DATA_LOADER_CASES, DATA_PIPELINE_CASE)


@dataclasses.dataclass
class BenchDataConfig:
    out: str = option("", "folder for results.json and the plots")
    cases: tuple[str, ...] = option(
        DATA_LOADER_CASES,
        f"cases to measure, of {', '.join(DATA_CASES)}; the loader cases time DataLoaders alone, {DATA_PIPELINE_CASE} "
        "the pipeline run loop on 224x224 JPEGs read by the driver (before) vs by stage 0's loader processes (after): "
        "samples/s and the driver's CPU seconds per sample; it starts a local Ray of its own (unless this process is "
        "connected to one) and 2 stage actors twice, so it runs only when named",
        group="benchmark",
    )
    num_images: int = option(512, "images per case, cut from scikit-learn's two sample photos")
    loader_batch_size: int = option(32, "samples per loader batch")
    loader_workers: tuple[int, ...] = option((1, 2), "loader process counts to measure")
    repeats: int = option(3, "timed passes over the images per figure (after one untimed pass)")
    seed: int = option(0, "seed of the image crops, the sample order and the augmentation")
    auto_augment: str | None = option(
        None,
        f"an auto-augment policy ({', '.join(POLICIES)}) in every loader case's augmenting loaders: ours (keyed "
        "draws, in the loader processes, as ddp --auto-augment does) and torchvision's ImageFolder (the policy after "
        "the flip, as its reference recipe); the per-sample float path predates the recipe and is left out",
        POLICIES,
    )
    pipeline_steps: int = option(
        30,
        f"{DATA_PIPELINE_CASE}: timed train steps per pass (each pass is its own epoch; the case makes "
        "more than --num-images images when one epoch would hold fewer steps)",
        group="benchmark",
    )
    pipeline_warmup: int = option(
        3, f"{DATA_PIPELINE_CASE}: untimed train steps before the timed passes", group="benchmark"
    )
    pipeline_batch_size: int = option(32, f"{DATA_PIPELINE_CASE}: samples per train step", group="benchmark")
    pipeline_microbatches: int = option(4, f"{DATA_PIPELINE_CASE}: micro-batches per train step (m)", group="benchmark")
    pipeline_loader_workers: int = option(
        1,
        f"{DATA_PIPELINE_CASE}: loader processes of stage 0 after the change (its bundle reserves a CPU for each; 0 "
        "decodes in the stage actor)",
        group="benchmark",
    )
    json: bool = False

    def validate(self) -> None:
        check(bool(self.out), "out", "an output folder is required")
        check_local("out", self.out, "a local folder (results.json and PNG plots are written there atomically)")
        check_writable("out", self.out)
        check(len(self.cases) >= 1, "cases", f"give at least one of {', '.join(DATA_CASES)}")
        unknown = [c for c in self.cases if c not in DATA_CASES]
        check(not unknown, "cases", f"unknown case(s) {unknown}; accepted: {', '.join(DATA_CASES)}")
        check(len(set(self.cases)) == len(self.cases), "cases", f"each case once, got {list(self.cases)}")
        if self.auto_augment is not None:
            check_choice(self, "auto_augment")
        check(self.repeats >= 1, "repeats", f"must be >= 1, got {self.repeats}")
        check(self.num_images >= 20, "num_images", f"must be >= 20 (one val image in 20), got {self.num_images}")
        if any(case in DATA_LOADER_CASES for case in self.cases):
            check(self.loader_batch_size >= 1, "loader_batch_size", f"must be >= 1, got {self.loader_batch_size}")
            check(
                self.num_images >= 2 * self.loader_batch_size,
                "num_images",
                f"must be at least twice --loader-batch-size {self.loader_batch_size}, got {self.num_images}",
            )
            check(
                len(self.loader_workers) >= 1 and min(self.loader_workers) >= 1,
                "loader_workers",
                f"each count must be >= 1, got {list(self.loader_workers)}",
            )
        check(self.pipeline_steps >= 1, "pipeline_steps", f"must be >= 1, got {self.pipeline_steps}")
        check(self.pipeline_warmup >= 0, "pipeline_warmup", f"must be >= 0, got {self.pipeline_warmup}")
        check(
            self.pipeline_microbatches >= 1, "pipeline_microbatches", f"must be >= 1, got {self.pipeline_microbatches}"
        )
        check(
            self.pipeline_batch_size >= 1 and self.pipeline_batch_size % self.pipeline_microbatches == 0,
            "pipeline_batch_size",
            f"must be a positive multiple of --pipeline-microbatches {self.pipeline_microbatches}, got "
            f"{self.pipeline_batch_size}",
        )
        check(
            self.pipeline_loader_workers >= 0,
            "pipeline_loader_workers",
            f"must be >= 0, got {self.pipeline_loader_workers}",
        )
