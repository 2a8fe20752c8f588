"""``raytrain-mp export``: a checkpoint's model as an ONNX, ``torch.export`` (.pt2) or TorchScript file.

Invariants:
- The file takes float32 images (N, C, S, S) normalized as the run's validation split is (the data
  set's mean/std) and returns logits; N, the batch, is dynamic.
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
import warnings
from pathlib import Path

import torch
from torch import nn

from raytrain_mp.errors import UsageError
from raytrain_mp.inference.checkpoint import load_run
from raytrain_mp.inference.config import ExportConfig
from raytrain_mp.storage import local_replacement

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


class _Input(nn.Module):
    """The model with its input named ``x`` (what ``dynamic_shapes`` keys on), whatever its forward calls it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def export_model(model: nn.Module, fmt: str, out: str | Path, channels: int, height: int, width: int) -> float:
    """Write ``model`` (eval mode) as ``fmt`` to ``out`` after checking it; the largest difference."""
    write, run = EXPORTERS[fmt]
    model = _Input(model.float()).eval()
    batches = check_batches(channels, height, width)
    out = Path(out).expanduser().resolve()
    with local_replacement(out, suffix=out.suffix) as tmp:
        write(model, torch.zeros(2, channels, height, width), tmp)
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
    return load_run(cfg.checkpoint)


def run_export(cfg: ExportConfig) -> dict:
    run, model = with_checked_inputs(cfg)
    meta, transform = run.meta, run.transform()
    height, width, channels = run.input_shape  # the crop of pretrained weights' preprocessing, else the data's
    difference = export_model(model, cfg.format, cfg.out, channels, height, width)
    return {
        "out": str(Path(cfg.out).expanduser().resolve()),
        "format": cfg.format,
        "checkpoint": run.checkpoint,
        "input": ["batch", channels, height, width],
        "mean": list(transform.mean),
        "std": list(transform.std),
        "class_names": meta.class_names,
        "max_abs_difference": difference,
        "checked_batches": list(CHECK_BATCHES),
    }
