"""Command configuration machinery and the options every training command shares.

Each command's own validated dataclass lives with its command (``data.config.PrepareConfig``,
``ddp.config.DDPConfig``, ``pipeline.config.PipelineConfig``, ``tune.config.TuneConfig``, the bench
configs) and is built from YAML and flags by ``build_config`` here; ``TrainOptions`` holds the
data, model, optimization and checkpoint options that ddp and pipeline share.

Invariants:
- Precedence is dataclass default < ``--config FILE`` (YAML) < command-line flag.
- Every field is one flag (``--global-batch-size`` for ``global_batch_size``); its help text and
  accepted values live in the field's metadata, so ``--help`` and the errors cannot drift apart.
- ``validate()`` is pure (no Ray, no filesystem writes) and runs before any cluster resource is
  requested; every problem is one ``UsageError`` line naming the option and what it accepts.
- ``--help`` lists the options in ``GROUPS`` (every field belongs to one, ``FIELD_GROUPS``), each
  default written as a user would type it; building the parser imports neither torch nor Ray.
- A renamed option keeps its old spelling (``aliases``) for one release, as a flag and as a YAML
  key, with one ``raytrain-mp: warning:`` line naming the new one; ``--help`` shows new names only.
- A saved config (``to_yaml``: checkpoints' ``config.yaml``, a sweep's ``sweep.yaml``) never holds
  a hidden option: those are testing hooks and what a driver hands its workers (``tracking``), not
  part of what was run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from raytrain_mp.errors import UsageError
from raytrain_mp.fault_injection import FaultSpec
from raytrain_mp.models import MODEL_HELP, check_model_syntax
from raytrain_mp.optim import OPTIMIZERS
from raytrain_mp.preprocessing import check_syntax as check_preprocess_syntax
from raytrain_mp.pretrained import check_syntax as check_weights_syntax

C = TypeVar("C")

PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
LAYOUTS = ("channels_last", "contiguous")  # memory formats a model computes in (``memory_format``)
MEMORY_FORMATS = ("auto", *LAYOUTS)  # what a trainer accepts: a layout, or measure both
LR_RULES = ("linear", "sqrt", "none")
LR_DECAYS = ("cosine", "step", "none")


GROUPS = ("data", "model", "optimization", "distribution", "checkpoints", "sweep", "benchmark", "output")
FIELD_GROUPS = {
    **dict.fromkeys(("data", "source", "val_fraction", "rows_per_shard", "num_samples", "image_size",
                     "num_classes", "channels", "overwrite", "augment", "encoded", "loader_workers", "preprocess",
                     "auto_augment", "ra_magnitude", "augmix_severity", "random_erase",
                     "train_crop_size", "val_resize_size", "val_crop_size", "interpolation", "ra_sampler", "ra_reps",
                     "loader_prefetch", "loader_batch_size", "num_images"), "data"),
    **dict.fromkeys(("model", "small_stem", "weights", "precision", "sync_bn", "deferred_bn",
                     "memory_format", "bn_momentum"), "model"),
    **dict.fromkeys(("epochs", "base_lr", "base_batch", "lr_rule", "warmup_epochs", "lr_decay", "step_epochs",
                     "gamma", "optimizer", "momentum", "weight_decay", "norm_weight_decay", "global_batch_size",
                     "batch_size_per_worker",
                     "grad_accum_steps", "clip_grad_norm", "lr", "seed", "freeze_backbone",
                     "backbone_lr_scale", "label_smoothing", "model_ema", "model_ema_steps",
                     "model_ema_decay", "mixup_alpha", "cutmix_alpha"), "optimization"),
    **dict.fromkeys(("address", "num_workers", "resize_interval", "resize_timeout", "use_gpu", "cpus_per_worker",
                     "placement", "stages", "replicas", "split_points", "balance", "schedule", "virtual_stages",
                     "microbatches", "steps_per_call", "cpus_per_stage", "bucket_cap_mb", "threads",
                     "balanced", "interleaved", "balance_microbatches", "balance_trials"), "distribution"),
    **dict.fromkeys(("storage_path", "name", "checkpoint_every", "checkpoint_every_steps", "num_to_keep",
                     "max_failures", "resume_from", "resume"), "checkpoints"),
    **dict.fromkeys(("base_lrs", "lr_min", "lr_max", "global_batch_sizes", "optimizers", "warmup_epochs_grid",
                     "weight_decays", "label_smoothings",
                     "search", "scheduler", "metric", "grace_period", "reduction_factor", "perturbation_interval",
                     "max_concurrent_trials"), "sweep"),
    **dict.fromkeys(("steps", "warmup", "resnet_rounds", "repeats", "hybrid", "hybrid_workers",
                     "hybrid_microbatches"), "benchmark"),
    **dict.fromkeys(("out", "log_every", "verbose", "quiet", "inject_fault", "hold_at_step"), "output"),
}  # fmt: skip


def option(
    default: Any,
    help: str,
    choices: tuple | None = None,
    hidden: bool = False,
    group: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field that is also a command-line flag; ``group`` overrides ``FIELD_GROUPS``
    (a name that means something else in one command), ``aliases`` are retired field names."""
    metadata = {"help": help, "choices": choices, "hidden": hidden, "group": group, "aliases": aliases}
    return dataclasses.field(default=default, metadata=metadata)


def group_of(field: dataclasses.Field) -> str:
    group = field.metadata.get("group") or FIELD_GROUPS.get(field.name)
    if group not in GROUPS:
        raise KeyError(f"option {field.name!r} belongs to no help group; add it to FIELD_GROUPS")
    return group


def as_typed(field: dataclasses.Field, value: Any) -> str | None:
    """A default as a user would type it on the command line (None: nothing to show)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return flag_name(field.name) if value else "--no-" + flag_name(field.name)[2:]
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value) if value != "" else None


def deprecation_notice(old: str, new: str) -> None:
    print(f"raytrain-mp: warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


class _DeprecatedFlag(argparse.Action):
    """A retired flag spelling: stores into the new option, after one warning line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        deprecation_notice(option_string, flag_name(self.dest))
        setattr(namespace, self.dest, values)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation like ``int | None``; of ``int | str`` (a
    count or a range) the first, tried first by ``_coerce``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return inner[0], type(None) in args
    return tp, False


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(cls: type, name: str, value: Any, source: str) -> Any:
    base, optional = _base_type(_field_types(cls)[name])
    flag = flag_name(name)
    if optional and isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    if value is None:
        if optional:
            return None
        raise UsageError(f"{flag}: a value is required ({source})")
    if base is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"{flag}: expected true or false, got {value!r} ({source})")
    if typing.get_origin(base) is tuple:  # tuple[T, ...]: a comma list as a flag, a list (or one value) in YAML
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        items = items if isinstance(items, list) else [items]
        return tuple(_convert(typing.get_args(base)[0], item, flag, source) for item in items)
    if base is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise UsageError(f"{flag}: expected a list, got {value!r} ({source})")
        return value
    if base is int and str in typing.get_args(_field_types(cls)[name]) and not _is_int(value):
        return str(value)  # e.g. --num-workers 2-8; the field's own validate() reads it
    return _convert(base, value, flag, source)


def _is_int(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value.strip().isdigit()
    )


def _convert(base: type, value: Any, flag: str, source: str) -> Any:
    try:
        if base is int and (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        if base in (int, float) and isinstance(value, bool):
            raise ValueError
        return base(value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag}: expected {base.__name__}, got {value!r} ({source})") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type, positional: tuple[str, ...] = ()) -> None:
    """Add ``--config`` and one flag per field of ``cls`` (but the ``positional`` ones); unspecified flags
    stay absent."""
    fields = [f for f in dataclasses.fields(cls) if f.name != "json" and f.name not in positional]
    groups = {
        name: parser.add_argument_group(f"{name} options")
        for name in GROUPS
        if any(group_of(f) == name for f in fields)
    }
    groups["output"] = groups.get("output") or parser.add_argument_group("output options")
    groups["output"].add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS, help="YAML file of options (flags win)"
    )
    for f in fields:
        base, _ = _base_type(_field_types(cls)[f.name])
        meta = f.metadata
        help_text = meta.get("help", "")
        default = as_typed(f, f.default)
        if "default" not in help_text:
            help_text += f" (default: {default})" if default is not None else (" (required)" if f.default == "" else "")
        if meta.get("hidden"):
            help_text = argparse.SUPPRESS
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        group = groups[group_of(f)]
        if base is bool:
            group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["metavar"] = f.name.upper()
        group.add_argument(flag_name(f.name), type=str, **kwargs)
        for alias in meta.get("aliases", ()):
            parser.add_argument(
                flag_name(alias),
                type=str,
                dest=f.name,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
                action=_DeprecatedFlag,
            )
    groups["output"].add_argument(
        "--json", action="store_true", default=False, help="print one JSON object as the last line"
    )


def read_yaml(path: str) -> dict[str, Any]:
    """The options of a YAML file, local or at a URI (a sweep's best.yaml in a bucket, say)."""
    from raytrain_mp.storage import locate

    file = locate(path, "--config")
    if not file.is_file():
        raise UsageError(f"--config: no such file {path}")
    try:
        data = yaml.safe_load(file.read_bytes().decode()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"--config: {path} is not valid YAML ({' '.join(str(exc).split())})") from exc
    if not isinstance(data, dict):
        raise UsageError(f"--config: {path} must hold a mapping of option: value")
    return data


def build_config(cls: type[C], args: argparse.Namespace | dict[str, Any]) -> C:
    """The validated config: defaults, then YAML from ``config``, then the given flags."""
    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    names = {f.name for f in dataclasses.fields(cls)}
    renamed = {alias: f.name for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}
    values: dict[str, Any] = {}
    config_path = given.pop("config", None)
    if config_path:
        for key, value in read_yaml(config_path).items():
            name = str(key).replace("-", "_")
            if name in renamed:
                deprecation_notice(f"{key!r} in {config_path}", repr(renamed[name]))
                name = renamed[name]
            if name not in names or name == "json":
                raise UsageError(
                    f"--config: unknown option {key!r} in {config_path}; accepted: "
                    f"{', '.join(sorted(names - {'json'}))}"
                )
            values[name] = _coerce(cls, name, value, f"in {config_path}")
    for name, value in given.items():
        if name in names:
            values[name] = value if isinstance(value, bool) else _coerce(cls, name, value, "flag")
    config = cls(**values)
    config.validate()
    return config


def check_choice(cls_or_config: Any, name: str) -> None:
    meta = next(f.metadata for f in dataclasses.fields(cls_or_config) if f.name == name)
    value = getattr(cls_or_config, name)
    if meta.get("choices") and value not in meta["choices"]:
        raise UsageError(f"{flag_name(name)}: unknown value {value!r}; accepted: {', '.join(meta['choices'])}")


def check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise UsageError(f"{flag_name(name)}: {message}")


def absolute_path(path: str | None) -> str | None:
    """A local path made absolute (``~`` expanded), so Ray workers, whose working folder is not the
    user's, read the same file; URIs and None pass unchanged."""
    if path is None or "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def check_writable(name: str, path: str) -> None:
    """A local folder we can create and write into, or a URI of a store pyarrow knows (whether its
    bucket exists is asked of the store before any worker starts: ``storage.check_reachable``)."""
    if "://" in path:
        from raytrain_mp.storage import check_uri

        check_uri(path, flag_name(name))
        return
    p = Path(path).expanduser()
    existing = p
    while not existing.exists():
        existing = existing.parent
    check(existing.is_dir() and os.access(existing, os.W_OK | os.X_OK), name, f"{path} is not writable")


def check_local(name: str, path: str, accepted: str) -> None:
    """An option that reads or writes a local file only: a URI is one line saying so."""
    check("://" not in path, name, f"{path} is a URI; accepted: {accepted}")


def to_yaml(config: Any) -> str:
    """``config`` as YAML that ``--config`` reads back: every field but ``json`` (an output switch)
    and the hidden ones (testing hooks such as ``inject_fault``), which no saved file carries."""
    hidden = {f.name for f in dataclasses.fields(config) if f.metadata.get("hidden")}
    data = {k: v for k, v in dataclasses.asdict(config).items() if k != "json" and k not in hidden}
    return yaml.safe_dump(data, sort_keys=False)


# --------------------------------------------------------------------------------------------------
# The options every training command shares (each command's own config subclasses it).


@dataclasses.dataclass
class TrainOptions:
    """Options every training command shares: data, model, optimization, checkpoints, resume."""

    data: str | None = option(None, "prepared data set folder or URI; default: built-in digits")
    model: str = option("resnet18", f"model: {MODEL_HELP}")
    small_stem: bool | None = option(None, "ResNets: 3x3 stride-1 stem without max-pool (default: on below 64 px)")
    weights: str | None = option(
        None,
        "weights to start from: a state dict file (a model.pt), or torchvision weights of --model (DEFAULT, "
        "IMAGENET1K_V1, ResNet50_Weights.IMAGENET1K_V2) from torchvision's cache (TORCH_HOME), downloaded when "
        "missing; another class count gets a new seeded head, another channel count an adapted stem",
    )
    preprocess: str | None = option(
        None,
        "how images become the model's input: data (the data set's mean/std at its size), weights (torchvision "
        "--weights' own resize, crop, interpolation, mean and std), or resize=R,crop=C,interpolation=I,mean=M:M:M,"
        "std=S:S:S (default: weights with torchvision --weights, else data; saved with the run for eval and predict)",
    )
    address: str | None = option(None, "Ray cluster address (default: RAY_ADDRESS, else a new local Ray)")
    epochs: int = option(6, "training epochs")
    base_lr: float = option(
        0.1,
        "learning rate at --base-batch samples; scaled to the batch (Goyal et al.: 0.1 at 256). "
        "The lr in progress lines and --json is the one the epoch's last step trained with",
    )
    base_batch: int = option(256, "batch size at which --base-lr applies")
    lr_rule: str = option("linear", "how lr scales with the batch", LR_RULES)
    warmup_epochs: float = option(1.0, "gradual linear warmup from base lr to scaled lr over these epochs")
    lr_decay: str = option("cosine", "decay after warmup", LR_DECAYS)
    step_epochs: int = option(30, "step decay: multiply lr by --gamma every this many epochs")
    gamma: float = option(0.1, "step decay factor")
    optimizer: str = option("sgd", "optimizer", OPTIMIZERS)
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(5e-4, "weight decay of conv and linear weights")
    norm_weight_decay: float = option(
        0.0, "normalization layers' weights and biases, and every bias: their weight decay (default 0, Goyal et al.)"
    )
    precision: str = option(
        "fp32", "fp32 | bf16 (autocast) | fp16 (CUDA, GradScaler) | fp64 (verification)", PRECISIONS
    )
    bn_momentum: float | None = option(
        None,
        "momentum of every BatchNorm layer's running statistics, in (0, 1] (default: the model's own: 0.1 in "
        "most torchvision models, 0.01 in MobileNetV3, too little for short runs)",
    )
    augment: bool = option(False, "random crop and horizontal flip, seeded per sample and epoch")
    seed: int = option(0, "seed of the model init, sample order and augmentation")
    storage_path: str = option("~/ray_results", "where runs and checkpoints go (local folder, NFS, s3://...)")
    name: str | None = option(
        None,
        "run name; rerun with the same name to resume (default: the command and the start time, e.g. "
        "ddp-20261130-113831)",
    )
    checkpoint_every: int = option(1, "write a checkpoint every this many epochs (and after the last)")
    num_to_keep: int = option(2, "checkpoints kept")
    max_failures: int = option(0, "restarts from the last checkpoint after a worker or stage failure")
    resume_from: str | None = option(None, "checkpoint folder (holding model.pt) to resume from")
    log_every: int | None = option(
        None,
        "progress line and metrics.csv step row every this many steps within an epoch (default: 50, or about 4 an "
        "epoch in epochs of fewer than 200 steps; 0: off)",
    )
    verbose: bool = option(False, "also show Ray's informational log lines (they are always in Ray's log files)")
    quiet: bool = option(False, "print only the summary: no progress or epoch lines (errors and warnings still print)")
    inject_fault: str | None = option(
        None, "testing: INDEX:EPOCH:MARKER fails worker/stage INDEX once after EPOCH", hidden=True
    )
    json: bool = False
    FAULTS_AT_STEPS = False  # --inject-fault takes only epochs; a command whose loop can fail after a step says so

    def validate(self) -> None:
        check_model_syntax(self.model)  # the name itself: models.check_model, once the data is known
        for name in ("lr_rule", "lr_decay", "optimizer", "precision"):
            check_choice(self, name)
        check(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        check(self.base_lr > 0, "base_lr", f"must be > 0, got {self.base_lr}")
        check(self.base_batch >= 1, "base_batch", f"must be >= 1, got {self.base_batch}")
        check(self.warmup_epochs >= 0, "warmup_epochs", f"must be >= 0, got {self.warmup_epochs}")
        check(self.step_epochs >= 1, "step_epochs", f"must be >= 1, got {self.step_epochs}")
        check(0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma}")
        check(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        if self.bn_momentum is not None:
            check(0 < self.bn_momentum <= 1, "bn_momentum", f"must be in (0, 1], got {self.bn_momentum}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.norm_weight_decay >= 0, "norm_weight_decay", f"must be >= 0, got {self.norm_weight_decay}")
        check(self.checkpoint_every >= 1, "checkpoint_every", f"must be >= 1, got {self.checkpoint_every}")
        check(self.num_to_keep >= 1, "num_to_keep", f"must be >= 1, got {self.num_to_keep}")
        check(self.max_failures >= -1, "max_failures", f"must be >= 0 (or -1: unlimited), got {self.max_failures}")
        check(self.log_every is None or self.log_every >= 0, "log_every", f"must be >= 0, got {self.log_every}")
        check(not (self.quiet and self.verbose), "quiet", "contradicts --verbose; accepted: one of them")
        check_writable("storage_path", self.storage_path)
        if self.weights is not None:
            check_weights_syntax(self.weights)  # a name's weights: pretrained.resolve, once the model is known
        check_preprocess_syntax(self.preprocess)
        if self.resume_from is not None:
            check_writable("resume_from", self.resume_from)  # a URI's scheme and bucket name
            check(
                (Path(self.resume_from) / "model.pt").is_file() or "://" in self.resume_from,
                "resume_from",
                f"{self.resume_from} holds no model.pt; accepted: a checkpoint folder written by this tool",
            )
        FaultSpec.parse(self.inject_fault, self.FAULTS_AT_STEPS)
