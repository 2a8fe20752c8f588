"""What ``raytrain-mp eval`` leaves in ``--out``: ``eval.json``, ``confusion.png`` and ``predictions.csv``.

Without ``--out`` they go into a new folder ``SPLIT-TIME`` (``val-20261206-071500``) of ``eval/`` in
the run folder that holds the checkpoint, beside its checkpoints and ``metrics.csv``; where that
folder is in an object store or not writable, or the checkpoint is in no run folder (a copied
checkpoint folder), into ``eval/NAME/SPLIT-TIME`` in the working directory, NAME the run's (or the
checkpoint folder's) name (``default_out``). A second evaluation never lands in the folder of the
first.

Invariants: per-class accuracy and the confusion matrix are computed from the all-reduced counts
(row = true class, column = predicted), a class with no samples has accuracy ``null``; every file
is written to a temporary name in ``--out`` and renamed (``storage.write_local``), so a file is there whole or
not at all, with the mode the user's umask gives an ordinary file.
Knows neither Ray nor torch.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path, PurePosixPath

import numpy as np

from raytrain_mp.plots import png_bytes, pyplot
from raytrain_mp.readable import number
from raytrain_mp.storage import is_uri, split_query, write_local

EVAL_FILE = "eval.json"
CONFUSION_FILE = "confusion.png"
PREDICTIONS_FILE = "predictions.csv"


def default_out(checkpoint: str, split: str, in_run: bool) -> str:
    """The folder eval writes to without ``--out`` (see the module doc) for the checkpoint folder
    ``checkpoint`` (a local path or a URI; ``in_run``: one of a run folder's checkpoints): a new
    one, ``-2``, ``-3``, ... added within a second."""
    folder = PurePosixPath(split_query(checkpoint)[0])
    run = folder.parent if in_run else folder
    if in_run and not is_uri(checkpoint) and os.access(run, os.W_OK | os.X_OK):
        parent = Path(run) / "eval"
    else:
        parent = Path.cwd() / "eval" / run.name
    name = f"{split}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = parent / name, 1
    while out.exists():
        n += 1
        out = parent / f"{name}-{n}"
    return str(out)


def per_class_accuracy(confusion: np.ndarray, names: list[str]) -> dict[str, float | None]:
    totals = confusion.sum(axis=1)
    return {name: (float(confusion[i, i] / totals[i]) if totals[i] else None) for i, name in enumerate(names)}


def confusion_png(confusion: np.ndarray, names: list[str], title: str) -> bytes:
    plt = pyplot()
    k = len(names)
    side = min(4 + 0.45 * k, 30)
    fig, ax = plt.subplots(figsize=(side, side))
    image = ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(k), names, rotation=90 if k > 10 or max(map(len, names)) > 4 else 0)
    ax.set_yticks(range(k), names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    if k <= 30:
        peak = confusion.max() or 1
        for i in range(k):
            for j in range(k):
                ax.text(
                    j,
                    i,
                    str(int(confusion[i, j])),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if confusion[i, j] > peak / 2 else "black",
                )
    fig.colorbar(image, ax=ax, fraction=0.046)
    return png_bytes(fig)


def write_eval_outputs(cfg, run, metrics: dict, names: list[str], labels: np.ndarray, ids: np.ndarray) -> dict:
    """Write the three files into ``cfg.out`` and return the summary (``--json``'s object)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    confusion = np.asarray(metrics["confusion"], dtype=np.int64)
    top_key = next(key for key in metrics if key.startswith("top") and key.endswith("_accuracy"))
    predicted = np.asarray(metrics["predicted"], dtype=np.int64)
    summary = {
        "accuracy": metrics["accuracy"],
        top_key: metrics[top_key],
        "loss": metrics["loss"],
        "count": metrics["count"],
        "split": cfg.split,
        "data": cfg.data,
        "checkpoint": run.checkpoint,
        "weights": run.weights,
        "world_size": metrics["world_size"],
        "per_class_accuracy": per_class_accuracy(confusion, names),
        "confusion": confusion.tolist(),
        "class_names": names,
    }
    write_local(out / EVAL_FILE, json.dumps(summary, indent=2).encode())
    title = f"{cfg.split} of {Path(cfg.data).name}: accuracy {number(metrics['accuracy'])} ({metrics['count']} samples)"
    write_local(out / CONFUSION_FILE, confusion_png(confusion, names, title))
    rows = io.StringIO()
    writer = csv.writer(rows)
    writer.writerow(["index", "id", "label", "predicted", "label_name", "predicted_name"])
    for i, (label, guess) in enumerate(zip(labels.tolist(), predicted.tolist())):
        writer.writerow([i, int(ids[i]), label, guess, names[label], names[guess]])
    write_local(out / PREDICTIONS_FILE, rows.getvalue().encode())
    return {
        **{k: v for k, v in summary.items() if k not in ("confusion", "per_class_accuracy", "class_names")},
        "per_class_accuracy": summary["per_class_accuracy"],
        "eval": str(out / EVAL_FILE),
        "confusion_png": str(out / CONFUSION_FILE),
        "predictions": str(out / PREDICTIONS_FILE),
    }
