"""``--checkpoint``: one complete checkpoint found from what the user names, and its model rebuilt.

Accepted: a checkpoint folder (``model.pt``, ``config.yaml``, ``train_state.pt``, as ddp, pipeline
and a sweep's trials write them), a run folder (``STORAGE/NAME`` or a sweep's ``train-<trial>``:
its newest complete ``checkpoint_*``, in the order ``checkpointing.checkpoint_order`` gives:
``checkpoint_000001_step_000010`` < ``checkpoint_000001`` < ``checkpoint_000002``), a sweep's
experiment folder (its best trial's run, by the sweep's ``--metric``, as ``best.yaml`` chose it), or a
URI of any of these.

Invariants:
- The model is rebuilt from the run's own ``config.yaml`` (``model``, ``small_stem``,
  ``precision``, ``data``, ``preprocess``: pretrained weights' resize, crop and mean/std, which
  ``transform`` applies as the run did) and the metadata of the data set it trained on (classes, channels,
  image size, class names, mean/std), with ``models.build_model``, so the user names nothing else;
  a ``package.module:callable`` model is rebuilt by calling it again. ``model.pt`` loads with
  ``strict=True``.
- A run folder stands for its newest published checkpoint (``checkpointing.is_published``); its
  torn checkpoints are skipped. A torn checkpoint named directly, or one whose ``model.pt`` does
  not load into the rebuilt model, is one ``UsageError`` line.
- Everything here runs before Ray starts and writes nothing.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import yaml

from raytrain_mp.checkpointing import (
    CHECKPOINT_FILES,
    CONFIG_FILE,
    EMA_FILE,
    MODEL_FILE,
    checkpoint_order,
    missing_files,
    published_checkpoints,
)
from raytrain_mp.data.format import DatasetMeta, read_meta
from raytrain_mp.data.transforms import BatchTransform
from raytrain_mp.errors import UsageError
from raytrain_mp.preprocessing import input_hw, input_size
from raytrain_mp.storage import COMPLETE_MARKER, Location, locate, name_of
from raytrain_mp.tune.config import SWEEP_FILE, metric_mode
from raytrain_mp.views import Views

OPTION = "--checkpoint"
ACCEPTED = (
    "accepted: a run folder or a checkpoint folder written by raytrain-mp ddp, pipeline or tune, or a URI of either"
)


def resolve_checkpoint(spec: str) -> Location:
    """The checkpoint folder ``spec`` names: itself, or a run folder's newest complete checkpoint."""
    folder = locate(spec, OPTION)
    if not folder.exists():
        raise UsageError(f"{OPTION}: no such folder {spec}; {ACCEPTED}")
    if folder.is_file():
        raise UsageError(f"{OPTION}: {spec} is a file; {ACCEPTED} (the folder that holds model.pt)")
    if any(folder.child(name).is_file() for name in CHECKPOINT_FILES):  # a checkpoint folder itself
        missing = missing_files(folder)
        if missing:
            raise UsageError(
                f"{OPTION}: {spec} is a torn checkpoint (no {', '.join(missing)}); use another checkpoint of the run, "
                "or the run folder"
            )
        return folder
    if folder.child(SWEEP_FILE).is_file():
        folder, spec = _best_trial_run(folder, spec)
    candidates, complete = published_checkpoints(folder)
    if complete:
        return complete[-1]
    if candidates:
        raise UsageError(
            f"{OPTION}: {spec} holds {len(candidates)} checkpoint folder(s), none complete (torn: no "
            f"{', '.join(missing_files(candidates[-1])) or COMPLETE_MARKER})"
        )
    raise UsageError(f"{OPTION}: {spec} holds no checkpoint; {ACCEPTED}")


def _best_trial_run(experiment: Location, spec: str) -> tuple[Location, str]:
    """A sweep's experiment folder stands for its best trial's run (by the sweep's ``--metric``,
    as its ``best.yaml`` was chosen): the run folder and how to name it in an error."""
    import pyarrow.parquet as pq

    from raytrain_mp.tune.report import TABLE_NAME, best_row

    table = experiment.child(f"{TABLE_NAME}.parquet")
    if not table.is_file():
        raise UsageError(
            f"{OPTION}: {spec} is a sweep without results yet (no {TABLE_NAME}.parquet); finish it with raytrain-mp "
            f"tune --resume {spec}"
        )
    options = yaml.safe_load(experiment.child(SWEEP_FILE).read_bytes().decode()) or {}
    metric = options.get("metric", "val_accuracy")
    best = best_row(pq.read_table(io.BytesIO(table.read_bytes())).to_pylist(), metric, metric_mode(metric))
    if best is None or not best.get("run"):
        raise UsageError(
            f"{OPTION}: {spec} is a sweep with no trial that reported {metric}; pass one of its train-<trial> run "
            "folders"
        )
    return experiment.child(best["run"]), f"{spec} (its best trial, {best['run']})"


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    """What a checkpoint says about its model: where it is, the run's options, and the metadata of
    the data set it trained on. Plain data: it ships to Ray workers, which rebuild the model."""

    checkpoint: str  # the checkpoint folder, as a path or URI a user can paste back
    options: dict[str, Any]  # the run's config.yaml
    data: str  # the data set the run trained on
    meta: DatasetMeta
    weights: str = MODEL_FILE  # the checkpoint's file of weights: model.pt, or ema.pt (--ema)

    @property
    def precision(self) -> str:
        return self.options.get("precision") or "fp32"

    @property
    def model_name(self) -> str:
        return self.options["model"]

    @property
    def preprocess(self) -> str | None:
        """The run's ``--preprocess`` spec as it trained (``preprocessing``; None: the data set's own)."""
        return self.options.get("preprocess")

    @property
    def views(self) -> Views:
        """The run's views of its data set (``views``): what its validation, and so eval and predict, cut."""
        return Views.of(self.meta, self.options)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of the model's input: the validation view (the data set's image shape unless the
        run cut other views), or the preprocessing's crop."""
        return (*input_hw(self.preprocess, *self.views.val_hw), self.meta.channels)

    def transform(self) -> BatchTransform:
        """What turns a batch of the split's uint8 images into the model's input, as the run's evaluation did."""
        return BatchTransform.for_run(self.meta, self.preprocess)

    @property
    def steps_trained(self) -> int | None:
        """Training steps the checkpoint has taken, from its name (``checkpointing.checkpoint_name``)
        and the data set's steps per epoch; None when the name or the options do not say."""
        batch = self.options.get("global_batch_size")
        try:
            epoch, step = checkpoint_order(name_of(self.checkpoint))
        except ValueError:
            return None
        if not batch:
            return None
        per_epoch = self.meta.counts["train"] // batch
        return epoch * per_epoch if step == float("inf") else (epoch - 1) * per_epoch + int(step)

    def dtype(self):
        import torch

        return torch.float64 if self.precision == "fp64" else torch.float32

    def build(self, state: dict | None = None):
        """The trained model in eval mode, on the CPU, in the run's dtype (``state``: its weights,
        read from the checkpoint when not given)."""
        from raytrain_mp.models import build_model

        meta = self.meta
        size = input_size(self.preprocess, self.views.training_size(bool(self.options.get("augment"))))
        model = build_model(
            self.model_name, meta.num_classes, meta.channels, self.options.get("small_stem"), image_size=size
        )
        state = read_state(locate(self.checkpoint, OPTION), self.weights) if state is None else state
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            first = (str(exc).splitlines()[1:2] or [str(exc)])[0].strip()
            raise UsageError(
                f"{OPTION}: {self.checkpoint}/{self.weights} does not fit the {self.model_name} its config.yaml names: "
                f"{first}"
            ) from None
        return model.to(self.dtype()).eval()


def read_state(checkpoint: Location, weights: str = MODEL_FILE) -> dict:
    import torch

    try:
        return torch.load(io.BytesIO(checkpoint.child(weights).read_bytes()), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        raise UsageError(
            f"{OPTION}: {checkpoint.uri}/{weights} is torn or not a torch state dict ({type(exc).__name__})"
        ) from None


def read_options(checkpoint: Location) -> dict[str, Any]:
    try:
        options = yaml.safe_load(checkpoint.child(CONFIG_FILE).read_bytes().decode())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageError(f"{OPTION}: {checkpoint.uri}/{CONFIG_FILE} is not valid YAML ({type(exc).__name__})") from None
    if not isinstance(options, dict) or not options.get("model"):
        raise UsageError(f"{OPTION}: {checkpoint.uri}/{CONFIG_FILE} names no model; {ACCEPTED}")
    return options


def load_run(spec: str, ema: bool = False) -> tuple[TrainedRun, Any]:
    """The resolved checkpoint's ``TrainedRun`` and its model (built and loaded, so a checkpoint
    that does not load is reported here, before Ray starts); ``ema``: its weight average."""
    from raytrain_mp.data.default import resolve_dataset

    checkpoint = resolve_checkpoint(spec)
    options = read_options(checkpoint)
    data = resolve_dataset(options.get("data"))
    try:
        meta = read_meta(data)
    except UsageError as exc:
        raise UsageError(
            f"{OPTION}: the run at {checkpoint.uri} trained on {data}, which cannot be read: {exc}"
        ) from None
    weights = EMA_FILE if ema else MODEL_FILE
    if ema and not checkpoint.child(EMA_FILE).is_file():
        raise UsageError(
            f"--ema: {checkpoint.uri} holds no {EMA_FILE}; accepted: a checkpoint of a run trained with --model-ema, "
            f"or no --ema (its {MODEL_FILE})"
        )
    run = TrainedRun(checkpoint.uri, options, data, meta, weights)
    state = read_state(checkpoint, weights)
    return run, run.build(state)


def check_data_fits(run: TrainedRun, meta: DatasetMeta, data: str) -> None:
    """``--data``'s images and classes are those the model was trained on."""
    h, w, c = meta.image_shape
    th, tw, tc = run.meta.image_shape
    if (meta.num_classes, meta.image_shape) != (run.meta.num_classes, run.meta.image_shape):
        raise UsageError(
            f"--data: {data} holds {c}x{h}x{w} images of {meta.num_classes} classes; the model at {run.checkpoint} "
            f"takes {tc}x{th}x{tw} images of {run.meta.num_classes} classes"
        )
