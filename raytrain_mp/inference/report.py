"""What ``raytrain-mp eval`` leaves in ``--out``: ``eval.json``, ``confusion.png`` and ``predictions.csv``.

Invariants: per-class accuracy and the confusion matrix are computed from the all-reduced counts
(row = true class, column = predicted), a class with no samples has accuracy ``null``; every file
is written to a temporary name in ``--out`` and renamed, so a file is there whole or not at all.
Knows neither Ray nor torch.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from raytrain_mp.plots import png_bytes, pyplot

EVAL_FILE = "eval.json"
CONFUSION_FILE = "confusion.png"
PREDICTIONS_FILE = "predictions.csv"


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


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
        "world_size": metrics["world_size"],
        "per_class_accuracy": per_class_accuracy(confusion, names),
        "confusion": confusion.tolist(),
        "class_names": names,
    }
    _write(out / EVAL_FILE, json.dumps(summary, indent=2).encode())
    title = f"{cfg.split} of {Path(cfg.data).name}: accuracy {metrics['accuracy']:.4f} ({metrics['count']} samples)"
    _write(out / CONFUSION_FILE, confusion_png(confusion, names, title))
    rows = io.StringIO()
    writer = csv.writer(rows)
    writer.writerow(["index", "id", "label", "predicted", "label_name", "predicted_name"])
    for i, (label, guess) in enumerate(zip(labels.tolist(), predicted.tolist())):
        writer.writerow([i, int(ids[i]), label, guess, names[label], names[guess]])
    _write(out / PREDICTIONS_FILE, rows.getvalue().encode())
    return {
        **{k: v for k, v in summary.items() if k not in ("confusion", "per_class_accuracy", "class_names")},
        "per_class_accuracy": summary["per_class_accuracy"],
        "eval": str(out / EVAL_FILE),
        "confusion_png": str(out / CONFUSION_FILE),
        "predictions": str(out / PREDICTIONS_FILE),
    }
