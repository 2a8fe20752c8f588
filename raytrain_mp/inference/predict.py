"""``raytrain-mp predict``: the top-k classes and probabilities of image files.

Every file is decoded and preprocessed on the driver first (``images``: as the run's validation
split is), so a bad file stops the command before anything runs. Fewer than ``RAY_THRESHOLD``
files are predicted in this process; more go to Ray tasks of ``CHUNK`` images each, every task
rebuilding the model from the checkpoint. Batches are normalized with the training data's
mean/std, or resized, cropped and normalized as the run's pretrained weights have it
(``TrainedRun.transform``), and run in eval mode, in the run's dtype and autocast, as the
trainers' evaluation runs them, so the classes are those ``eval`` predicts for the same images.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import torch

from raytrain_mp.compilation import check_compiler, compiler
from raytrain_mp.inference.checkpoint import TrainedRun, load_run
from raytrain_mp.inference.config import PredictConfig
from raytrain_mp.inference.images import collect_files, load_image
from raytrain_mp.precision import autocast_for
from raytrain_mp.storage import write_local

RAY_THRESHOLD = 512  # files; below it, starting Ray costs more than it saves
CHUNK = 256
BATCH = 64


@dataclasses.dataclass
class Inputs:
    run: TrainedRun
    files: list[Path]
    images: list[torch.Tensor]


def with_checked_inputs(cfg: PredictConfig) -> tuple[PredictConfig, Inputs]:
    check_compiler(cfg)
    run, _ = load_run(cfg.checkpoint, cfg.ema)
    files = collect_files(cfg.files)
    images = [load_image(f, run.meta, run.views) for f in files]
    return dataclasses.replace(cfg, checkpoint=run.checkpoint), Inputs(run, files, images)


def probabilities(run: TrainedRun, images: list[torch.Tensor], model=None, options=None) -> torch.Tensor:
    """Softmax probabilities (N, K) of uint8 images, in batches of ``BATCH``; compiled where
    ``options`` (``PredictConfig``) say ``--compile``."""
    model = model if model is not None else run.build()
    compile = compiler(options) if options is not None else None
    model = compile(model) if compile is not None else model
    device = torch.device("cpu")
    transform = run.transform()
    autocast = autocast_for(run.precision, device)
    out = []
    with torch.no_grad():
        for start in range(0, len(images), BATCH):
            batch = torch.stack(images[start : start + BATCH])
            x = transform(batch, torch.zeros(len(batch), 3, dtype=torch.int64), device, run.dtype())
            with autocast():
                logits = model(x)
            out.append(torch.softmax(logits.double(), dim=1))
    return torch.cat(out)


def _ray_probabilities(cfg: PredictConfig, inputs: Inputs) -> torch.Tensor:
    import ray

    from raytrain_mp.cluster import ray_connection

    task = ray.remote(num_cpus=1)(probabilities)
    with ray_connection(cfg.address, cfg.verbose):
        chunks = [inputs.images[s : s + CHUNK] for s in range(0, len(inputs.images), CHUNK)]
        refs = [task.remote(inputs.run, chunk, None, cfg) for chunk in chunks]
        return torch.cat(ray.get(refs))


def run_predict(cfg: PredictConfig, inputs: Inputs) -> dict:
    if len(inputs.images) >= RAY_THRESHOLD:
        probs = _ray_probabilities(cfg, inputs)
    else:
        probs = probabilities(inputs.run, inputs.images, options=cfg)
    names = inputs.run.meta.class_names
    top = min(cfg.top_k, len(names))
    values, indices = probs.topk(top, dim=1)
    predictions = [
        {
            "file": str(file),
            "classes": [names[i] for i in idx.tolist()],
            "indices": idx.tolist(),
            "probabilities": vals.tolist(),
        }
        for file, vals, idx in zip(inputs.files, values, indices)
    ]
    result = {
        "checkpoint": inputs.run.checkpoint,
        "weights": inputs.run.weights,
        "count": len(predictions),
        "top_k": top,
        "predictions": predictions,
    }
    if cfg.csv:
        write_csv(Path(cfg.csv).expanduser(), predictions, top)
        result["csv"] = str(Path(cfg.csv).expanduser().resolve())
    return result


def write_csv(path: Path, predictions: list[dict], top: int) -> None:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["file", *[f"{kind}_{r}" for r in range(1, top + 1) for kind in ("class", "probability")]])
    for p in predictions:
        writer.writerow([p["file"], *[v for pair in zip(p["classes"], p["probabilities"]) for v in pair]])
    write_local(path, text.getvalue().encode())


def print_predictions(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    for p in result["predictions"]:
        print(f"{p['file']}: " + ", ".join(f"{c} ({v:.3f})" for c, v in zip(p["classes"], p["probabilities"])))
    if "csv" in result:
        print(f"predictions written to {result['csv']}")
