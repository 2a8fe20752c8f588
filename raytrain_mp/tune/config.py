"""What a learning-rate sweep is: the validated ``TuneConfig`` of ``raytrain-mp tune``.

Pure: no Ray, no writes. A sweep is a search space over the six per-trial DDP options (``base_lr``,
``global_batch_size``, ``optimizer``, ``warmup_epochs``, ``weight_decay``, ``label_smoothing``)
plus every other ``DDPConfig`` option, applied to every trial alike. Invariants:

- ``TuneConfig`` takes its per-trial-alike fields from ``DDPConfig`` itself (same names, types,
  defaults, help), so a DDP option can never be missing from, or differ in, the sweep command.
- A trial's config is ``dataclasses.replace(template, **params)`` with ``params`` keyed by
  ``DDPConfig`` field names, so the best trial's config is a plain ``DDPConfig``.
- ``validate()`` rejects every bad grid and every option a trial would reject, before any trial
  starts; ``trials_that_fit`` rejects a trial larger than the cluster and caps concurrency so
  that running trials' workers always fit (Tune would otherwise start trial drivers whose workers
  wait forever, ray issue 54305).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import random
import typing
from typing import Any

from raytrain_mp.config import absolute_path, build_config, check, check_choice, flag_name, option
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.ddp.elastic import check_world_sizes, parse_worker_range
from raytrain_mp.errors import UsageError
from raytrain_mp.optim import OPTIMIZERS

# Per-trial DDP options: their values come from the search space (keys of a trial's params).
PER_TRIAL = ("base_lr", "global_batch_size", "optimizer", "warmup_epochs", "weight_decay", "label_smoothing")
# DDP options a sweep does not pass on: it names the experiment itself and each trial's run,
# resuming every trial from one checkpoint is not a sweep, and a trial reports to Tune once an
# epoch at a fixed size (ASHA compares epochs), so neither step checkpoints nor resizes apply.
NOT_PASSED_ON = ("name", "resume_from", "json", "checkpoint_every_steps", "resize_interval")

DEFAULT_BASE_LRS = (0.1, 0.2, 0.4, 0.8)
SEARCHES = ("grid", "random", "optuna")
SCHEDULERS = ("asha", "pbt", "none")
# What PBT perturbs: the options it can change mid-run (``optim.load_under_own_options``); a batch
# size, optimizer or warmup would change what the checkpoint's state means.
PERTURBED = ("base_lr", "weight_decay")
DEFAULT_NUM_SAMPLES = 8
# The trial's function (it builds and fits the TorchTrainer) is a Tune actor; it mostly waits, but
# reserving a CPU for it keeps the count of trials that fit honest.
TRIAL_DRIVER_CPUS = 1.0
SWEEP_FILE = "sweep.yaml"


def metric_mode(metric: str) -> str:
    """Whether the best trial has the largest ``metric`` (accuracy) or the smallest (loss)."""
    return "max" if metric == "val_accuracy" else "min"


@dataclasses.dataclass
class SweepOptions:
    """The options only a sweep has; ``TuneConfig`` adds the DDP options to these."""

    base_lrs: tuple[float, ...] | None = option(
        None,
        f"grid of base learning rates, e.g. 0.1,0.2,0.4 (default: {','.join(map(str, DEFAULT_BASE_LRS))} "
        "unless --lr-min/--lr-max)",
    )
    lr_min: float | None = option(None, "log-uniform search instead of a grid: smallest base lr (with --lr-max)")
    lr_max: float | None = option(None, "log-uniform search: largest base lr (with --lr-min)")
    search: str = option(
        "grid",
        "how points are chosen: every combination of the grids (grid); --num-samples points drawn from them "
        "(random, seeded by --seed), or proposed by Optuna's TPE from the trials so far (optuna: pip install "
        "'raytrain_mp[optuna]'); with --lr-min/--lr-max the lr is log-uniform",
        SEARCHES,
    )
    num_samples: int | None = option(
        None,
        "random and optuna: the trials; grid with --lr-min/--lr-max: base lrs drawn (seeded by --seed), each tried "
        f"at every grid point (default: {DEFAULT_NUM_SAMPLES})",
        group="sweep",
    )
    global_batch_sizes: tuple[int, ...] = option((64, 128), "grid of global batch sizes")
    optimizers: tuple[str, ...] = option((DDPConfig.optimizer,), f"grid of optimizers ({', '.join(OPTIMIZERS)})")
    warmup_epochs_grid: tuple[float, ...] = option((DDPConfig.warmup_epochs,), "grid of warmup epochs")
    weight_decays: tuple[float, ...] = option(
        (DDPConfig.weight_decay,), "grid of weight decays (of conv and linear weights; --norm-weight-decay is fixed)"
    )
    label_smoothings: tuple[float, ...] = option(
        (DDPConfig.label_smoothing,), "grid of label smoothings, each in [0, 1)"
    )
    scheduler: str = option(
        "asha",
        "early stopping of weak trials (ASHA on --metric); pbt: every --perturbation-interval epochs the worst "
        "quarter of trials continue from a best quarter's checkpoint with its lr and weight decay perturbed "
        "(Population Based Training); or none",
        SCHEDULERS,
    )
    metric: str = option(
        "val_accuracy", "what picks the best trial (and what ASHA compares)", ("val_accuracy", "val_loss")
    )
    grace_period: int = option(1, "asha: epochs every trial runs before it may be stopped")
    reduction_factor: float = option(2.0, "asha: at each rung, keep the best 1/this of trials")
    perturbation_interval: int = option(1, "pbt: epochs between two exploits of better trials' checkpoints")
    max_concurrent_trials: int | None = option(
        None, "trials at once (default: as many as the cluster fits, each trial's driver CPU and workers counted)"
    )
    name: str | None = option(None, "experiment name; its folder is --storage-path/NAME (default: tune-<time>)")
    resume: str | None = option(
        None, f"experiment folder of an interrupted sweep to finish (its options come from its {SWEEP_FILE})"
    )
    json: bool = False

    @property
    def mode(self) -> str:
        return metric_mode(self.metric)

    @property
    def log_uniform(self) -> bool:
        return self.lr_min is not None or self.lr_max is not None

    def grid(self) -> dict[str, tuple]:
        """The search space: every combination of these values, keyed by ``DDPConfig`` field, is a trial."""
        return {
            "global_batch_size": self.global_batch_sizes,
            "optimizer": self.optimizers,
            "warmup_epochs": self.warmup_epochs_grid,
            "weight_decay": self.weight_decays,
            "label_smoothing": self.label_smoothings,
            "base_lr": self.base_lr_values(),
        }

    def base_lr_values(self) -> tuple[float, ...]:
        """The grid, or ``num_samples`` log-uniform draws seeded by ``--seed``, sorted.

        Drawn here rather than by Tune so that every grid point gets the same lrs (the curves of the
        plot share their x values) and a rerun with the same seed tries the same lrs."""
        if not self.log_uniform:
            return self.base_lrs if self.base_lrs is not None else DEFAULT_BASE_LRS
        rng = random.Random(self.seed)
        low, high = math.log(self.lr_min), math.log(self.lr_max)
        draws = (math.exp(rng.uniform(low, high)) for _ in range(self.num_samples or DEFAULT_NUM_SAMPLES))
        return tuple(sorted(float(f"{lr:.4g}") for lr in draws))  # 4 digits: readable in trial names and tables

    def num_trials(self) -> int:
        if self.search != "grid":
            return self.num_samples or DEFAULT_NUM_SAMPLES
        return math.prod(len(values) for values in self.grid().values())

    def varying(self) -> dict[str, tuple]:
        """The dimensions a random or Optuna search chooses from (more than one value each; the lr
        counts as varying with a range); the others hold their one value in every trial."""
        grid = self.grid()
        return {
            name: values for name, values in grid.items() if len(values) > 1 or (name == "base_lr" and self.log_uniform)
        }

    def perturbed(self) -> dict[str, tuple]:
        """What PBT may resample: the lr (its range or its grid) and the weight decays, where they vary."""
        return {name: values for name, values in self.varying().items() if name in PERTURBED}

    def template(self) -> DDPConfig:
        """The DDP config every trial shares; the per-trial fields hold the first grid point."""
        shared = {name: getattr(self, name) for name in _passed_on_names()}
        first = {name: values[0] for name, values in self.grid().items()}
        return DDPConfig(**shared, **first)

    def validate(self) -> None:
        for name in ("search", "scheduler", "metric"):
            check_choice(self, name)
        self._validate_lrs()
        self._validate_search()
        check(
            bool(self.global_batch_sizes),
            "global_batch_sizes",
            "the grid is empty; accepted: a comma list of batch sizes",
        )
        low, high = parse_worker_range(self.num_workers)
        check(
            low == high,
            "num_workers",
            f"a sweep's trials run at one size; accepted: a worker count, got {self.num_workers}",
        )
        for batch in self.global_batch_sizes:
            check(batch >= 1, "global_batch_sizes", f"must be >= 1, got {batch}")
            check_world_sizes(batch, self.grad_accum_steps, low, high, option="--global-batch-sizes")
        check(bool(self.optimizers), "optimizers", f"the grid is empty; accepted: {', '.join(OPTIMIZERS)}")
        for name in self.optimizers:
            check(name in OPTIMIZERS, "optimizers", f"unknown value {name!r}; accepted: {', '.join(OPTIMIZERS)}")
        check(
            bool(self.warmup_epochs_grid), "warmup_epochs_grid", "the grid is empty; accepted: a comma list of epochs"
        )
        for epochs in self.warmup_epochs_grid:
            check(epochs >= 0, "warmup_epochs_grid", f"must be >= 0, got {epochs}")
        check(bool(self.weight_decays), "weight_decays", "the grid is empty; accepted: a comma list of weight decays")
        for decay in self.weight_decays:
            check(decay >= 0, "weight_decays", f"must be >= 0, got {decay}")
        check(bool(self.label_smoothings), "label_smoothings", "the grid is empty; accepted: a comma list in [0, 1)")
        for smoothing in self.label_smoothings:
            check(0 <= smoothing < 1, "label_smoothings", f"must be in [0, 1), got {smoothing}")
        check(
            1 <= self.grace_period <= self.epochs,
            "grace_period",
            f"must be in [1, --epochs {self.epochs}], got {self.grace_period}",
        )
        check(self.reduction_factor > 1, "reduction_factor", f"must be > 1, got {self.reduction_factor}")
        check(
            self.max_concurrent_trials is None or self.max_concurrent_trials >= 1,
            "max_concurrent_trials",
            f"must be >= 1, got {self.max_concurrent_trials}",
        )
        self.template().validate()  # every other option, checked exactly as the ddp command checks it

    def _validate_search(self) -> None:
        defaults = SweepOptions()
        check(
            self.search != "optuna" or importlib.util.find_spec("optuna") is not None,
            "search",
            "optuna needs Optuna, which is not installed; accepted: pip install 'raytrain_mp[optuna]', or grid, random",
        )
        check(
            self.search == "grid" or bool(self.varying()),
            "search",
            f"{self.search}: nothing to choose, every grid has one value; accepted: --lr-min/--lr-max or a grid "
            "of several values",
        )
        if self.scheduler != "asha":
            for name in ("grace_period", "reduction_factor"):
                check(
                    getattr(self, name) == getattr(defaults, name),
                    name,
                    f"only with --scheduler asha, got --scheduler {self.scheduler}",
                )
        if self.scheduler != "pbt":
            check(
                self.perturbation_interval == defaults.perturbation_interval,
                "perturbation_interval",
                f"only with --scheduler pbt, got --scheduler {self.scheduler}",
            )
            return
        check(
            1 <= self.perturbation_interval < self.epochs,
            "perturbation_interval",
            f"must be in [1, --epochs {self.epochs}) (an exploit needs an epoch after it), "
            f"got {self.perturbation_interval}",
        )
        check(
            bool(self.perturbed()),
            "scheduler",
            "pbt perturbs the lr and the weight decay, and neither varies; accepted: --lr-min/--lr-max, "
            "several --base-lrs or several --weight-decays",
        )

    def _validate_lrs(self) -> None:
        if self.log_uniform:
            check(
                self.base_lrs is None,
                "base_lrs",
                "give either a grid (--base-lrs) or a range (--lr-min/--lr-max), not both",
            )
            check(self.lr_min is not None and self.lr_max is not None, "lr_min", "--lr-min and --lr-max go together")
            check(_positive(self.lr_min), "lr_min", f"must be a finite number > 0, got {self.lr_min}")
            check(
                _positive(self.lr_max) and self.lr_max > self.lr_min,
                "lr_max",
                f"must be > --lr-min {self.lr_min}, got {self.lr_max}",
            )
            check(
                self.num_samples is None or self.num_samples >= 1,
                "num_samples",
                f"must be >= 1, got {self.num_samples}",
            )
            return
        if self.search != "grid":
            check(
                self.num_samples is None or self.num_samples >= 1,
                "num_samples",
                f"must be >= 1, got {self.num_samples}",
            )
        else:
            check(
                self.num_samples is None,
                "num_samples",
                "a grid tries each value once; accepted: --num-samples with --search random or optuna, "
                "or with --lr-min/--lr-max",
            )
        check(
            self.base_lrs is None or bool(self.base_lrs),
            "base_lrs",
            "the grid is empty; accepted: a comma list of learning rates",
        )
        for lr in self.base_lrs or ():
            check(_positive(lr), "base_lrs", f"must be finite numbers > 0, got {lr}")


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _passed_on_names() -> list[str]:
    return [f.name for f in dataclasses.fields(DDPConfig) if f.name not in PER_TRIAL + NOT_PASSED_ON]


def _passed_on_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    hints = typing.get_type_hints(DDPConfig)
    fields = {f.name: f for f in dataclasses.fields(DDPConfig)}
    return [
        (name, hints[name], dataclasses.field(default=fields[name].default, metadata=fields[name].metadata))
        for name in _passed_on_names()
    ]


# The sweep's own options first (they lead --help), then DDPConfig's fields, taken from it.
TuneConfig = dataclasses.make_dataclass(
    "TuneConfig",
    _passed_on_fields(),
    bases=(SweepOptions,),
    namespace={"__module__": __name__, "__doc__": "Options of `raytrain-mp tune`: the sweep's, then every trial's."},
)


def tune_config_from_args(args: argparse.Namespace | dict[str, Any]) -> Any:
    """The validated ``TuneConfig`` of a command line; ``--resume PATH`` takes PATH's saved options."""
    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    if given.get("resume") is None:
        return build_config(TuneConfig, given)
    from raytrain_mp.storage import join, locate

    resume = absolute_path(given["resume"])
    saved = join(resume, SWEEP_FILE)
    check(
        locate(saved, "--resume").is_file(),
        "resume",
        f"{given['resume']} holds no {SWEEP_FILE}; accepted: a folder made by raytrain-mp tune",
    )
    # Trials already ran with the saved options; other values would make one sweep of two.
    extra = sorted(set(given) - {"resume", "address", "json"})
    if extra:
        raise UsageError(
            f"--resume takes every option from {saved}; drop {', '.join(flag_name(name) for name in extra)}"
        )
    return build_config(TuneConfig, {**given, "config": saved, "resume": resume})


def trial_config(template: DDPConfig, params: dict[str, Any], **overrides: Any) -> DDPConfig:
    """One trial's DDP config: the template with the trial's point of the search space."""
    unknown = set(params) - set(PER_TRIAL)
    if unknown:
        raise ValueError(f"not per-trial options: {sorted(unknown)}")
    return dataclasses.replace(template, **params, **overrides)


def trials_that_fit(
    cluster_cpus: float, cluster_gpus: float, num_workers: int, cpus_per_worker: int, use_gpu: bool
) -> int:
    """How many trials run at once without any trial's workers waiting for resources; >= 1 or UsageError."""
    trial_cpus = TRIAL_DRIVER_CPUS + num_workers * cpus_per_worker
    if trial_cpus > cluster_cpus:
        raise UsageError(
            f"--num-workers {num_workers}: a trial needs {trial_cpus:g} CPUs ({TRIAL_DRIVER_CPUS:g} for its driver + "
            f"{num_workers} x --cpus-per-worker {cpus_per_worker}) but the Ray cluster has {cluster_cpus:g}; "
            f"accepted: at most {max(0, int((cluster_cpus - TRIAL_DRIVER_CPUS) // cpus_per_worker))} workers"
        )
    fit = int(cluster_cpus // trial_cpus)
    if use_gpu:
        if num_workers > cluster_gpus:
            raise UsageError(
                f"--num-workers {num_workers}: a trial needs {num_workers} GPUs but the Ray cluster has "
                f"{cluster_gpus:g}; accepted: at most {int(cluster_gpus)} with --use-gpu, or --no-use-gpu"
            )
        fit = min(fit, int(cluster_gpus // num_workers))
    return fit


def concurrency(cfg: Any, cluster_cpus: float, cluster_gpus: float, use_gpu: bool) -> int:
    """``--max-concurrent-trials``, or what fits; more than fits is a UsageError (it would deadlock)."""
    fit = trials_that_fit(cluster_cpus, cluster_gpus, int(cfg.num_workers), cfg.cpus_per_worker, use_gpu)
    if cfg.max_concurrent_trials is None:
        return fit
    check(
        cfg.max_concurrent_trials <= fit,
        "max_concurrent_trials",
        f"{cfg.max_concurrent_trials} trials do not fit on the Ray cluster ({cluster_cpus:g} CPUs, "
        f"{cluster_gpus:g} GPUs); accepted: at most {fit}",
    )
    return cfg.max_concurrent_trials
