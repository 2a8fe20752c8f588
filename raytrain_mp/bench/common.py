"""What every benchmark shares: timing steps, summarizing them, describing the machine, writing results.

Job: keep the benchmarks' method identical, so their figures compare: a figure is the median of
``steps`` timed calls after ``warmup`` untimed ones, reported with its min and max; the JSON holds
the machine (CPU count, GPU names, torch and ray versions, load average) next to the figures.
``torchrun`` launches the bare torch.distributed peers (``bench.ddp_bare``,
``bench.pipeline_native``) one way: ``--settings JSON --result PATH``, rank 0 writes the JSON.
``bar_chart`` and ``curve_chart`` draw every benchmark's plots the same way: medians with min-max
whiskers. ``bench_use_gpu`` decides the device one way: as given, else GPUs when this machine has
one for every rank of the largest variant (as the trainers decide), and ``join_torchrun_group``
puts a torchrun rank on it. ``in_fresh_process`` runs a one-process reference in a child that
exits, so its CUDA context and cached memory are gone before the measured runs use the GPU.

``pooled`` makes the runs of several rounds (each side's sweep measured in turn, so that a shared
machine's drift hits the sides alike) one run a point.

Invariants: ``summarize`` never sees an empty list (``timed`` refuses ``steps < 1``); ``pooled``
pools rounds only of the same points in the same order (``zip(strict=True)``) and keeps each
round's median next to the pooled figure; results are
written atomically (a half-written ``results.json`` never exists); plots use matplotlib's Agg
backend, so no display is needed; a torchrun that fails raises, with the tail of its stderr.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from raytrain_mp.plots import png_bytes, pyplot
from raytrain_mp.storage import write_local

T = TypeVar("T")


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a non-empty series."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed(step: Callable[[], Any], warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step``, after ``warmup`` calls that are not timed.

    ``step`` must return only when its work is done (synchronize devices inside it)."""
    if steps < 1:
        raise ValueError(f"steps: need at least one timed step, got {steps}")
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return seconds


def machine() -> dict[str, Any]:
    """The machine a result was measured on; the load average says how busy it was at the time."""
    import ray

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "load_average_start": list(os.getloadavg()),
    }


def write_results(out: str | Path, results: dict[str, Any]) -> Path:
    """Write ``results.json`` into ``out`` (created), stamping the load average at the end."""
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    results["machine"]["load_average_end"] = list(os.getloadavg())
    path = folder / "results.json"
    write_local(path, (json.dumps(results, indent=2) + "\n").encode())
    return path


def torchrun(module: str, nproc: int, settings: dict[str, Any], threads: int, what: str) -> dict[str, Any]:
    """Run ``python -m module --settings JSON --result PATH`` as ``nproc`` ranks of a standalone
    torchrun with ``OMP_NUM_THREADS=threads``, and return the JSON its rank 0 wrote to PATH.

    Raises ``RuntimeError`` naming ``what``, the exit code and the tail of stderr when torchrun
    fails or rank 0 wrote nothing."""
    with tempfile.TemporaryDirectory(prefix="bench-torchrun-") as tmp:
        result = Path(tmp) / "rank0.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", module, "--settings", json.dumps(settings), "--result", str(result),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{what} failed (exit code {done.returncode}): {done.stderr[-3000:]}")
        if not result.is_file():
            raise RuntimeError(f"{what} exited 0 but rank 0 wrote no result: {done.stderr[-3000:]}")
        return json.loads(result.read_text())


def bench_use_gpu(use_gpu: bool | None, ranks: int) -> bool:
    """``--use-gpu`` as given, else True when this machine has a CUDA GPU for each of ``ranks``."""
    return torch.cuda.device_count() >= max(1, ranks) if use_gpu is None else use_gpu


def join_torchrun_group(use_gpu: bool) -> torch.device:
    """Join the process group torchrun describes: NCCL with rank r on GPU ``LOCAL_RANK``, or gloo on CPUs."""
    if not use_gpu:
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def in_fresh_process(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a spawned child process that exits afterwards (``fn`` must be importable)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _medians_and_whiskers(figures: Sequence[dict[str, float]]) -> tuple[list[float], list[list[float]]]:
    """The medians, and the distances down to the minima and up to the maxima (matplotlib's yerr)."""
    medians = [f["median"] for f in figures]
    return medians, [[m - f["min"] for m, f in zip(medians, figures)], [f["max"] - m for m, f in zip(medians, figures)]]


def bar_chart(path: Path, labels: Sequence[str], figures: Sequence[dict[str, float]], ylabel: str, title: str) -> None:
    """Bars of the medians with min-max whiskers, each bar labelled with its median."""
    plt = pyplot()
    medians, whiskers = _medians_and_whiskers(figures)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(labels)), 4.5))
    bars = ax.bar(range(len(labels)), medians, yerr=whiskers, capsize=6, color="#4C72B0")
    ax.bar_label(bars, labels=[f"{m:.3g}" for m in medians], padding=3)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.margins(y=0.15)
    _save(fig, ax, path, ylabel, title)


def curve_chart(
    path: Path,
    curves: dict[str, tuple[Sequence[tuple[int, dict[str, float]]], str]],
    xticks: Sequence[int],
    xlabel: str,
    ylabel: str,
    title: str,
) -> None:
    """One line per curve, ``label -> ([(x, figure), ...], line style)``: medians with min-max
    error bars over a log-2 x axis; a curve without points is left out."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (points, style) in curves.items():
        if not points:
            continue
        med, err = _medians_and_whiskers([f for _, f in points])
        ax.errorbar([x for x, _ in points], med, yerr=err, marker="o", capsize=3, linestyle=style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xticks), [str(x) for x in xticks])
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=8)
    _save(fig, ax, path, ylabel, title)


def _save(fig: Any, ax: Any, path: Path, ylabel: str, title: str) -> None:
    """Label the y axis, title the chart, write it as a PNG and free the figure."""
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    write_local(path, png_bytes(fig, dpi=120))


def pooled(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The runs of several rounds of one sweep (the same points in the same order) as one: per
    point, each figure of its ``samples`` pooled over the rounds (``samples`` then holds every
    round's) and summarized, its per-round medians under ``round_medians``, and the first round's
    other entries (busy seconds per stage, activation memory: figures measured once a point)."""
    runs = []
    for same in zip(*rounds, strict=True):
        samples = {figure: [value for run in same for value in run["samples"][figure]] for figure in same[0]["samples"]}
        first = {key: value for key, value in same[0].items() if key not in samples}
        runs.append(
            {
                **first,
                **{figure: summarize(values) for figure, values in samples.items()},
                "samples": samples,
                "round_medians": {figure: [run[figure]["median"] for run in same] for figure in samples},
            }
        )
    return runs
