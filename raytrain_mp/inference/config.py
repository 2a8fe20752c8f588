"""The validated configs of ``raytrain-mp eval``, ``predict`` and ``export``, one dataclass each.

Pure: no torch, no Ray, no reads of the checkpoint; ``validate()`` checks each option's own form.
What needs the checkpoint (is there one, does the data fit the model) is checked by
``checkpoint.load_run`` and the commands' ``with_checked_inputs``, still before Ray starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from raytrain_mp.compile_options import CompileOptions
from raytrain_mp.config import check, check_choice, check_local, check_writable, option
from raytrain_mp.tracking_options import TrackingOptions

CHECKPOINT_HELP = (
    "a run folder (its newest complete checkpoint), a checkpoint folder (holding model.pt and config.yaml), "
    "or a URI of either; the model, its data set and class names come from what the run saved"
)
EVAL_SPLITS = ("val", "train")
EXPORT_FORMATS = ("onnx", "pt2", "torchscript")
EMA_HELP = "use the weight average (ema.pt of a run trained with --model-ema) instead of model.pt"


def check_file_writable(name: str, path: str) -> None:
    """A local file we may create or replace: its folder (or the nearest existing one above) is writable."""
    check_local(name, path, "a local file")
    check(not Path(path).expanduser().is_dir(), name, f"{path} is a folder; accepted: the file to write")
    check_writable(name, str(Path(path).expanduser().parent))


@dataclasses.dataclass
class EvalConfig(CompileOptions, TrackingOptions):
    """``raytrain-mp eval``: exact evaluation of a checkpoint on a split, on Ray Train workers;
    ``--mlflow``: its outputs as artifacts of the MLflow run of the checkpoint's run."""

    mlflow: bool = option(
        False,
        "also log eval.json, confusion.png and predictions.csv to the MLflow run of the checkpoint's run (eval/OUT/), "
        "at MLFLOW_TRACKING_URI; a new MLflow run when it has none",
        group="output",
    )
    checkpoint: str = option("", CHECKPOINT_HELP, group="checkpoints")
    ema: bool = option(False, EMA_HELP, group="checkpoints")
    data: str | None = option(
        None, "prepared data set folder or URI to evaluate on (default: the one the run trained on)"
    )
    split: str = option("val", "split to evaluate", EVAL_SPLITS, group="data")
    num_workers: int = option(
        2, "Ray Train workers (evaluation ranks; every sample is evaluated once, whatever the count)"
    )
    use_gpu: bool | None = option(None, "one GPU per worker (default: when the cluster has one for each worker)")
    address: str | None = option(None, "Ray cluster address (default: RAY_ADDRESS, else a new local Ray)")
    out: str | None = option(
        None,
        "local folder for eval.json, confusion.png (class names on the axes) and predictions.csv (default: a new "
        "folder eval/SPLIT-TIME in the checkpoint's run folder; for a run in an object store or one you cannot "
        "write, eval/RUN/SPLIT-TIME in the working directory)",
    )
    verbose: bool = option(False, "also show Ray's informational log lines (they are always in Ray's log files)")
    json: bool = False

    def validate(self) -> None:
        super().validate()
        check(bool(self.checkpoint), "checkpoint", "required: a run folder, a checkpoint folder, or a URI of either")
        check_choice(self, "split")
        check(self.num_workers >= 1, "num_workers", f"must be >= 1, got {self.num_workers}")
        if self.out is not None:
            check_local("out", self.out, "a local folder")
            check_writable("out", self.out)


@dataclasses.dataclass
class PredictConfig(CompileOptions):
    """``raytrain-mp predict``: the top-k classes of image files, preprocessed as the run's validation split."""

    checkpoint: str = option("", CHECKPOINT_HELP, group="checkpoints")
    ema: bool = option(False, EMA_HELP, group="checkpoints")
    files: tuple[str, ...] = option((), "image files (JPEG, PNG, any mode PIL reads) or folders of them", group="data")
    top_k: int = option(5, "classes reported per file, most probable first", group="output")
    csv: str | None = option(None, "also write the predictions as CSV to this local file", group="output")
    address: str | None = option(
        None, "Ray cluster address (default: RAY_ADDRESS, else a new local Ray); used when there are many files"
    )
    verbose: bool = option(False, "also show Ray's informational log lines (they are always in Ray's log files)")
    json: bool = False

    def validate(self) -> None:
        super().validate()
        check(bool(self.checkpoint), "checkpoint", "required: a run folder, a checkpoint folder, or a URI of either")
        check(bool(self.files), "files", "required: one or more image files or folders")
        check(self.top_k >= 1, "top_k", f"must be >= 1, got {self.top_k}")
        if self.csv is not None:
            check_file_writable("csv", self.csv)


@dataclasses.dataclass
class ExportConfig:
    """``raytrain-mp export``: the checkpoint's model as an ONNX, ``torch.export`` (.pt2) or TorchScript file."""

    checkpoint: str = option("", CHECKPOINT_HELP, group="checkpoints")
    ema: bool = option(False, EMA_HELP, group="checkpoints")
    format: str = option(
        "onnx",
        "onnx (needs pip install -e '.[export]') | pt2 (torch.export) | torchscript",
        EXPORT_FORMATS,
        group="output",
    )
    out: str = option("", "local file to write the exported model to (and OUT.json, what it takes and returns)")
    with_preprocessing: bool = option(
        False,
        "the model takes uint8 pixels (N, C, H, W) and normalizes them itself (default: float32, normalized by the "
        "data set's mean/std)",
        group="output",
    )
    json: bool = False

    def validate(self) -> None:
        check(bool(self.checkpoint), "checkpoint", "required: a run folder, a checkpoint folder, or a URI of either")
        check_choice(self, "format")
        check(bool(self.out), "out", "required: the local file to write")
        check_file_writable("out", self.out)
