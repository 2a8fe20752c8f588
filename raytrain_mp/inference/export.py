"""``raytrain-mp export``: a checkpoint's model as an ONNX, ``torch.export`` (.pt2) or TorchScript file.

Invariants:
- The file takes float32 images (N, C, S, S) normalized as the run's validation split is (the data
  set's mean/std, on the 0-255 pixel scale: ``(pixel - mean) / std``) and returns logits; N, the
  batch, is dynamic. With ``--with-preprocessing`` it takes the uint8 pixels (N, C, S, S) instead
  and the normalization is the graph's first step (``_Preprocess``), so a caller only decodes,
  resizes and crops.
- Beside the file, ``OUT.json`` (``sidecar_path``) says what it eats and returns (``sidecar``):
  the input's name, shape, layout, dtype and value range, the mean/std and whether the graph
  applies them, the image mode (channel order), the resize and crop that make an image file the
  run's validation view (``inference.images``), the output's name and the class names. It is
  written, as the checkpoint's other files are, whole or not at all (``Location.write_bytes``),
  after the model file passed its check.
- The export is written to a temporary file beside ``--out``, loaded back (onnxruntime, ``torch.export.load``,
  ``torch.jit.load``) and run on seeded batches of ``CHECK_BATCHES`` sizes; only when the largest
  difference from the PyTorch model is within the format's ``TOLERANCE`` is it renamed to ``--out``,
  with the mode the user's umask gives an ordinary file (``storage.local_replacement``).
  Otherwise nothing is written and the command fails naming the difference.
- ONNX needs the optional extra (``onnx``, ``onnxruntime``, ``onnxscript`` for torch's exporter);
  without it the command is one line naming ``pip install -e '.[export]'``, before anything runs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import warnings
from pathlib import Path

import torch
from torch import nn

from raytrain_mp.data.format import DatasetMeta
from raytrain_mp.data.pixels import CHANNEL_MODES
from raytrain_mp.data.transforms import BatchTransform
from raytrain_mp.errors import UsageError
from raytrain_mp.inference.checkpoint import load_run
from raytrain_mp.inference.config import ExportConfig
from raytrain_mp.storage import local_replacement, locate
from raytrain_mp.views import Views

CHECK_BATCHES = (1, 7)
TOLERANCE = {"onnx": 1e-4, "pt2": 1e-5, "torchscript": 1e-5}
ONNX_MODULES = ("onnx", "onnxruntime", "onnxscript")
EXTRA = "pip install -e '.[export]'"


class ExportMismatch(RuntimeError):
    """The exported file disagrees with the PyTorch model beyond the format's tolerance."""


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def check_dependencies(fmt: str) -> None:
    if fmt != "onnx":
        return
    missing = [name for name in ONNX_MODULES if not _importable(name)]
    if missing:
        raise UsageError(
            f"--format onnx: needs {', '.join(missing)}, which are not installed; install the export extra: {EXTRA}"
        )


def check_batches(channels: int, height: int, width: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, channels, height, width, generator=generator) for n in CHECK_BATCHES]


def _export_onnx(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=4096)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes={"x": {0: batch}},
            verbose=False,
        )
    program.save(str(path))


def _run_onnx(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def _export_pt2(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(model, (example,), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(path))


def _run_pt2(path: Path, x: torch.Tensor) -> torch.Tensor:
    return torch.export.load(str(path)).module()(x)


def _export_torchscript(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 deprecates torch.jit; the format is still asked for
        traced = torch.jit.trace(model, example, check_trace=False)
        torch.jit.save(traced, str(path))


def _run_torchscript(path: Path, x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.load(str(path))(x)


EXPORTERS = {
    "onnx": (_export_onnx, _run_onnx),
    "pt2": (_export_pt2, _run_pt2),
    "torchscript": (_export_torchscript, _run_torchscript),
}


class _Preprocess(nn.Module):
    """The model after the normalization, taking uint8 pixels (N, C, S, S) named ``x``."""

    def __init__(self, model: nn.Module, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x.to(torch.float32) - self.mean) / self.std)  # as data.transforms.BatchTransform


class _Input(nn.Module):
    """The model with its input named ``x`` (what ``dynamic_shapes`` keys on), whatever its forward calls it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def export_model(
    model: nn.Module,
    fmt: str,
    out: str | Path,
    channels: int,
    height: int,
    width: int,
    normalization: tuple[list[float], list[float]] | None = None,
) -> float:
    """Write ``model`` (eval mode) as ``fmt`` to ``out`` after checking it; the largest difference.
    ``normalization`` (mean, std): the file takes uint8 pixels and normalizes them itself."""
    write, run = EXPORTERS[fmt]
    if normalization is None:
        model = _Input(model.float()).eval()
        batches = check_batches(channels, height, width)
        example = torch.zeros(2, channels, height, width)
    else:
        model = _Preprocess(model.float(), *normalization).eval()
        generator = torch.Generator().manual_seed(0)
        shapes = [(n, channels, height, width) for n in CHECK_BATCHES]
        batches = [torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8) for shape in shapes]
        example = torch.zeros(2, channels, height, width, dtype=torch.uint8)
    out = Path(out).expanduser().resolve()
    with local_replacement(out, suffix=out.suffix) as tmp:
        write(model, example, tmp)
        with torch.no_grad():
            difference = max((run(tmp, x).float() - model(x)).abs().max().item() for x in batches)
        if not difference <= TOLERANCE[fmt]:
            raise ExportMismatch(
                f"the {fmt} export differs from the PyTorch model by {difference:.3g} (> {TOLERANCE[fmt]}); nothing "
                "written"
            )
    return difference


def with_checked_inputs(cfg: ExportConfig):
    """The run and its model, after every check that needs no export: the extra, the checkpoint."""
    check_dependencies(cfg.format)
    return load_run(cfg.checkpoint, cfg.ema)


def sidecar_path(out: str | Path) -> Path:
    """``model.onnx`` -> ``model.onnx.json``."""
    out = Path(out).expanduser().resolve()
    return out.with_name(out.name + ".json")


def sidecar(
    meta: DatasetMeta,
    transform: BatchTransform,
    views: Views,
    input_shape: tuple[int, int, int],
    fmt: str,
    out: Path,
    checkpoint: str,
    with_preprocessing: bool,
) -> dict:
    """What the exported file eats and returns, for a caller that has only the file and this.
    ``transform``: the run's evaluation transform (``TrainedRun.transform``), whose mean/std (and,
    for pretrained weights' preprocessing, resize and crop) the caller applies; ``views``: the run's
    (``TrainedRun.views``: an encoded data set's validation resize and interpolation); ``input_shape``:
    (H, W, C) of the model's input."""
    height, width, channels = input_shape
    mean, std = list(transform.mean), list(transform.std)
    if with_preprocessing:
        dtype, value_range = "uint8", [0, 255]
    else:
        low = [(0 - m) / s for m, s in zip(mean, std)]
        high = [(255 - m) / s for m, s in zip(mean, std)]
        dtype, value_range = "float32", [min(low), max(high)]
    if transform.resize:  # pretrained weights' preprocessing; resizing commutes with the normalization
        resize = {"shorter_side": transform.resize, "interpolation": transform.interpolation, "antialias": True}
        crop = {"center": [transform.crop, transform.crop]}
    elif meta.encoded:  # data.encoded.val_view at the run's views, which predict applies to an image file too
        resize = {"shorter_side": views.val_resize, "interpolation": views.interpolation, "antialias": True}
        crop = {"center": [height, width]}
    else:  # inference.images.load_image: as data prepare resized the data set's images
        resize, crop = {"size": [height, width], "interpolation": "bilinear"}, None
    return {
        "model": out.name,
        "format": fmt,
        "checkpoint": checkpoint,
        "input": {
            "name": "images" if fmt == "onnx" else "x",
            "shape": ["batch", channels, height, width],
            "layout": "NCHW",
            "dtype": dtype,
            "value_range": value_range,
            "image_mode": "RGB" if meta.encoded else CHANNEL_MODES.get(channels),
        },
        "normalization": {
            "mean": mean,
            "std": std,
            "pixel_scale": [0, 255],
            "formula": "(pixel - mean) / std, per channel",
            "in_graph": with_preprocessing,
        },
        "resize": resize,
        "crop": crop,
        "output": {"name": "logits" if fmt == "onnx" else "output", "shape": ["batch", meta.num_classes]},
        "class_names": meta.class_names,
    }


def run_export(cfg: ExportConfig) -> dict:
    run, model = with_checked_inputs(cfg)
    meta, transform = run.meta, run.transform()
    height, width, channels = run.input_shape  # the crop of pretrained weights' preprocessing, else the data's
    normalization = (list(transform.mean), list(transform.std)) if cfg.with_preprocessing else None
    difference = export_model(model, cfg.format, cfg.out, channels, height, width, normalization)
    out = Path(cfg.out).expanduser().resolve()
    described = sidecar(
        meta, transform, run.views, run.input_shape, cfg.format, out, run.checkpoint, cfg.with_preprocessing
    )
    locate(str(sidecar_path(out)), "--out").write_bytes((json.dumps(described, indent=2) + "\n").encode())
    return {
        "out": str(out),
        "sidecar": str(sidecar_path(out)),
        "format": cfg.format,
        "checkpoint": run.checkpoint,
        "weights": run.weights,
        "input": ["batch", channels, height, width],
        "input_dtype": described["input"]["dtype"],
        "mean": list(transform.mean),
        "std": list(transform.std),
        "class_names": meta.class_names,
        "max_abs_difference": difference,
        "checked_batches": list(CHECK_BATCHES),
    }
