"""Turn a finished sweep's trials into its outputs: the table, the plot and the best config.

Knows neither Ray nor Tune: trials arrive as ``TrialOutcome`` records. Invariants:

- The table has one row per trial, errored and early-stopped ones included, and the same columns
  and types (``COLUMNS``) whatever the trials, in CSV and Parquet alike.
- ``effective_lr`` is ``scaled_lr(base_lr, global_batch_size, base_batch, lr_rule)``: the peak lr the
  trial trained with.
- The best trial is picked from the table alone (best ``--metric`` over its epochs, errored trials
  never), and its YAML holds ``DDPConfig`` fields only, so ``raytrain-mp ddp --config`` accepts it.
- ``best.yaml`` holds what the sweep chose and the user gave, never this machine's state: the four
  per-trial values, ``epochs`` and ``model``, and the other options the user set to a non-default
  value, but none of ``MACHINE_STATE`` nor hidden (testing) options. It is built from the options
  as the user gave them (``TuneConfig.template()`` of the prepared config: ``data`` None unless
  ``--data`` was given, ``use_gpu`` unresolved), so another cluster reruns it as it would the sweep.
- Outputs are written through pyarrow's filesystems, so a URI storage path works like a folder.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import yaml

from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.lr_schedule import scaled_lr
from raytrain_mp.plots import png_bytes, pyplot
from raytrain_mp.storage import locate
from raytrain_mp.tune.config import PER_TRIAL, trial_config

TABLE_NAME = "sweep_table"
PLOT_FILE = "sweep_lr.png"
BEST_FILE = "best.yaml"
# Always in best.yaml besides the per-trial values: what was trained, and for how long.
BEST_ALWAYS = ("epochs", "model")
# DDP options that describe the machine or the run rather than the training: which cluster and
# whether it had GPUs (``use_gpu`` is resolved from the cluster), where the run was written and
# under which name, what it resumed from, how much it printed. best.yaml never holds them.
MACHINE_STATE = ("use_gpu", "address", "storage_path", "name", "resume_from", "verbose")
# Per-trial options besides the batch and the lr: a plot's curve is one combination of those that vary.
# Each with its name in a curve's legend.
CURVE_OPTIONS = {
    "optimizer": "optimizer",
    "warmup_epochs": "warmup",
    "weight_decay": "wd",
    "label_smoothing": "smoothing",
}

COLUMNS = pa.schema(
    [
        ("trial", pa.string()),
        ("base_lr", pa.float64()),
        ("global_batch_size", pa.int64()),
        ("world_size", pa.int64()),
        ("effective_lr", pa.float64()),
        ("lr_rule", pa.string()),
        ("optimizer", pa.string()),
        ("warmup_epochs", pa.float64()),
        ("weight_decay", pa.float64()),
        ("label_smoothing", pa.float64()),
        ("best_val_accuracy", pa.float64()),
        ("best_val_loss", pa.float64()),
        ("final_val_accuracy", pa.float64()),
        ("epochs_run", pa.int64()),
        ("status", pa.string()),  # completed | stopped (by the scheduler) | error
        ("error", pa.string()),
        ("run", pa.string()),  # the trial's Train run folder in the experiment, train-<trial id> (checkpoints)
    ]
)


@dataclass(frozen=True)
class TrialOutcome:
    """What one finished trial left: its point of the search space, its per-epoch metrics, its error."""

    trial: str
    params: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    run: str | None = None  # its Train run folder's name; None if it never reported


def table_rows(outcomes: Sequence[TrialOutcome], template: DDPConfig) -> list[dict[str, Any]]:
    """One row per trial, in ``COLUMNS`` order, sorted by batch, then ``CURVE_OPTIONS``, then base lr."""
    rows = []
    for outcome in outcomes:
        cfg = trial_config(template, outcome.params)
        epochs = [h for h in outcome.history if "epoch" in h]
        run = max((int(h["epoch"]) for h in epochs), default=0)
        status = "error" if outcome.error else "completed" if run >= cfg.epochs else "stopped"
        # After a resume an epoch may be reported twice; the last report of the last epoch is final.
        final = next((h for h in reversed(epochs) if int(h["epoch"]) == run), {})
        rows.append(
            {
                "trial": outcome.trial,
                "base_lr": cfg.base_lr,
                "global_batch_size": cfg.global_batch_size,
                "world_size": int(final.get("world_size", cfg.num_workers)),
                "effective_lr": scaled_lr(cfg.base_lr, cfg.global_batch_size, cfg.base_batch, cfg.lr_rule),
                "lr_rule": cfg.lr_rule,
                "optimizer": cfg.optimizer,
                "warmup_epochs": cfg.warmup_epochs,
                "weight_decay": cfg.weight_decay,
                "label_smoothing": cfg.label_smoothing,
                "best_val_accuracy": max((h["val_accuracy"] for h in epochs), default=None),
                "best_val_loss": min((h["val_loss"] for h in epochs), default=None),
                "final_val_accuracy": final.get("val_accuracy"),
                "epochs_run": run,
                "status": status,
                "error": outcome.error.strip().splitlines()[-1][:500] if outcome.error else None,
                "run": outcome.run,
            }
        )
    return sorted(
        rows, key=lambda r: (r["global_batch_size"], *(r[k] for k in CURVE_OPTIONS), r["base_lr"], r["trial"])
    )


def best_row(rows: Sequence[dict[str, Any]], metric: str, mode: str) -> dict[str, Any] | None:
    """The trial with the best ``best_<metric>``, failed ones aside; None when there is none."""
    column = f"best_{metric}"
    scored = [r for r in rows if r["status"] != "error" and r[column] is not None and math.isfinite(r[column])]
    if not scored:
        return None
    pick = max if mode == "max" else min
    return pick(scored, key=lambda r: r[column])


def best_options(row: dict[str, Any], given: DDPConfig) -> dict[str, Any]:
    """The best trial's options, by ``DDPConfig`` field in field order: the per-trial values of
    ``row``, ``BEST_ALWAYS``, and every other option ``given`` sets to a non-default value, except
    ``MACHINE_STATE``, hidden options and ``json``. ``given`` is the sweep's options as the user
    gave them, not the template resolved for this cluster."""
    options: dict[str, Any] = {}
    for f in dataclasses.fields(DDPConfig):
        if f.name in PER_TRIAL:
            options[f.name] = row[f.name]
        elif f.name in BEST_ALWAYS:
            options[f.name] = getattr(given, f.name)
        elif f.name in MACHINE_STATE or f.name == "json" or f.metadata.get("hidden"):
            continue
        elif getattr(given, f.name) != f.default:
            options[f.name] = getattr(given, f.name)
    return options


def best_yaml(row: dict[str, Any], given: DDPConfig, metric: str, experiment: str) -> str:
    header = (
        f"# Best trial of the sweep {experiment}: {row['trial']}\n"
        f"# best {metric} {row[f'best_{metric}']:.6g}, effective lr {row['effective_lr']:.6g}\n"
        f"# Run it: raytrain-mp ddp --config {BEST_FILE} [--epochs N ...]\n"
    )
    return header + yaml.safe_dump(best_options(row, given), sort_keys=False)


def write_outputs(
    rows: Sequence[dict[str, Any]], given: DDPConfig, metric: str, mode: str, folder: str
) -> dict[str, Any]:
    """Write table (CSV, Parquet), plot and best YAML into ``folder``; return their paths and the best row.

    ``given``: the sweep's DDP options as the user gave them (see ``best_options``)."""
    table = pa.Table.from_pylist(list(rows), schema=COLUMNS)
    csv = io.BytesIO()
    pa_csv.write_csv(table, csv)
    parquet = io.BytesIO()
    pq.write_table(table, parquet)
    best = best_row(rows, metric, mode)
    paths = {
        "table_csv": write_file(folder, f"{TABLE_NAME}.csv", csv.getvalue()),
        "table_parquet": write_file(folder, f"{TABLE_NAME}.parquet", parquet.getvalue()),
        "plot": write_file(folder, PLOT_FILE, plot_png(rows, f"rule {given.lr_rule}, {given.model}")),
        "best_yaml": write_file(folder, BEST_FILE, best_yaml(best, given, metric, folder).encode()) if best else None,
    }
    return {**paths, "best": best}


def plot_png(rows: Sequence[dict[str, Any]], subtitle: str) -> bytes:
    """Final val accuracy vs base lr (log x), one curve per global batch size (and per value of each
    of ``CURVE_OPTIONS`` that varies); each curve's peak is starred, early-stopped trials are hollow."""
    plt = pyplot()
    varying = [key for key in CURVE_OPTIONS if len({r[key] for r in rows}) > 1]
    curves: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["final_val_accuracy"] is not None:
            curves.setdefault((r["global_batch_size"], *(r[k] for k in varying)), []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, points in sorted(curves.items()):
        points.sort(key=lambda r: r["base_lr"])
        label = ", ".join([f"batch {key[0]}", *(f"{CURVE_OPTIONS[k]} {v}" for k, v in zip(varying, key[1:]))])
        xs, ys = [p["base_lr"] for p in points], [p["final_val_accuracy"] for p in points]
        (line,) = ax.plot(xs, ys, "-", label=label)
        for p in points:
            filled = p["status"] == "completed"
            ax.plot(
                p["base_lr"],
                p["final_val_accuracy"],
                "o",
                color=line.get_color(),
                mfc=line.get_color() if filled else "none",
            )
        peak = max(points, key=lambda r: r["final_val_accuracy"])
        ax.plot(peak["base_lr"], peak["final_val_accuracy"], "*", ms=14, color=line.get_color())
    ax.set_xscale("log")
    lrs = sorted({p["base_lr"] for points in curves.values() for p in points})
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], rotation=45 if len(lrs) > 8 else 0)
    ax.minorticks_off()  # the tried lrs label the axis; log-scale minor labels would crowd them
    ax.set_xlabel("base learning rate (at the base batch; scaled per trial by the rule)")
    ax.set_ylabel("final validation accuracy")
    ax.set_title(f"Learning-rate sweep ({subtitle})\n* peak per curve; hollow: stopped early")
    ax.grid(True, which="both", alpha=0.3)
    if curves:
        ax.legend()
    return png_bytes(fig, dpi=110)


def write_file(folder: str, name: str, data: bytes) -> str:
    """Write ``data`` to ``folder/name`` (a local folder or a URI) and return that path or URI."""
    file = locate(folder, "--storage-path").child(name)
    file.write_bytes(data)
    return file.uri
