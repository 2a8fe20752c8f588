"""``raytrain-mp bench data``: input samples/s, ours against what users run today, same images.

Job: for the loader cases of ``--cases`` (default all three: 32x32 raw pixels, CIFAR-like;
224x224 raw pixels; 224x224 JPEG files of their own size, decoded with the ImageNet recipe), and
for each loader process count of ``--loader-workers``, measure how many training samples per
second a ``DataLoader`` delivers:

- ours: ``ParquetImageDataset`` (augmentation on) through ``data.loader``: uint8 batches plus
  augmentation parameters; normalization, crop and flip are left to the training device;
- ours plus the batch transform on this CPU (raw cases): the same batches made float32 model
  inputs by ``ParquetImageDataset.transform`` in this process, the per-core cost when the training
  device is the CPU;
- the per-sample float path it replaced (``bench.data_peers.PerSampleFloatDataset``, raw cases);
- torchvision's ``ImageFolder`` + PIL transforms + ``DataLoader`` over the same images as files
  (PNG for the raw cases, so the pixels are the same; the JPEG files themselves for the encoded one).

With ``--auto-augment POLICY`` ours and torchvision's run that policy too (torchvision's own ops on
the uint8 image in both; ours under keyed draws), and the per-sample float path, which has no
policy, is left out: the cost of the policy is this run's figures against a run without it.

And, only when ``--cases`` names it, ``pipeline_input_jpeg_224`` (``bench.data_pipeline``): the pipeline
run loop with the driver reading each batch against stage loaders reading them.

Invariants: every loader of a case reads the same images (cut from scikit-learn's two bundled
photos, seeded), with the same batch size and process count; loader processes are persistent and
one untimed pass over the images starts them and warms the page cache, so a figure is the median
(and min, max) of ``--repeats`` timed passes; per process figures are the figures divided by the
process count. Beside wall-clock samples/s, every figure has its samples per CPU second (all
processes of the loader, this one included): on a shared machine the wall clock measures the
neighbours too, CPU time only what the loader itself spent. Writes
``results.json`` and one bar chart per loader case, two for the pipeline case.
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_mp.bench.common import bar_chart, machine, summarize, write_results
from raytrain_mp.bench.config import DATA_PIPELINE_CASE, BenchDataConfig
from raytrain_mp.bench.data_images import CASES, VAL_FRACTION, make_images
from raytrain_mp.bench.data_peers import PerSampleFloatDataset, torchvision_loader
from raytrain_mp.bench.data_pipeline import measure_pipeline_input, pipeline_plots
from raytrain_mp.data import ParquetImageDataset
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.data.prepare import prepare
from raytrain_mp.data.recipe_draws import Recipe

CPU_TICK = 0.01  # the resolution of cpu_times() without /proc: a shorter pass (tiny settings) counts one tick


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live children (the loader processes): what
    a pass costs in cores, whatever else shares the machine's cores meanwhile."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in (me, *me.children(recursive=True)):
        try:
            total += _cpu_of(process)
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):  # a loader measured before, ending now
            pass
    return total


def _cpu_of(process) -> float:
    tasks = Path(f"/proc/{process.pid}/task")
    if tasks.is_dir():  # Linux: every thread's run time in nanoseconds, where cpu_times() counts 10 ms ticks
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks.iterdir()) / 1e9
    return sum(process.cpu_times()[:2])


def measure_passes(loader: DataLoader, repeats: int, transform=None) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each of ``repeats`` full passes over ``loader``, after one untimed
    pass; ``transform`` (ours plus the CPU batch transform) runs on each batch in this process."""
    sampler = loader.sampler

    def one_pass() -> None:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(sampler.epoch + 1)
        for batch in loader:
            if transform is not None:
                transform(batch[0], batch[2])

    one_pass()
    walls, cpus = [], []
    for _ in range(repeats):
        cpu, wall = cpu_seconds(), time.perf_counter()
        one_pass()
        walls.append(time.perf_counter() - wall)
        cpus.append(max(cpu_seconds() - cpu, CPU_TICK))
    return walls, cpus


def rates(walls: list[float], cpus: list[float], samples: int, processes: int) -> dict[str, Any]:
    """samples/s of each pass, summarized: in all, per loader process, and per CPU second that
    the pass took in all processes (the loader processes and this one)."""
    per_second = [samples / s for s in walls]
    return {
        "samples_per_second": summarize(per_second),
        "per_process": summarize([r / processes for r in per_second]),
        "samples_per_cpu_second": summarize([samples / c for c in cpus]),
    }


def measure_case(cfg: BenchDataConfig, name: str, root: Path) -> dict[str, Any]:
    """Every loader of one case, for each process count; ``root`` is a scratch folder."""
    side, encoded = CASES[name]
    images = make_images(root / "images", cfg.num_images, None if encoded else side, cfg.seed)
    prepared = root / "prepared"
    options = {"encoded": True, "image_size": side} if encoded else {}
    prepare(f"imagefolder:{images}", prepared, val_fraction=VAL_FRACTION, seed=cfg.seed, **options)
    ours_ds = ParquetImageDataset(
        str(prepared), "train", augment=True, seed=cfg.seed, recipe=Recipe(auto_augment=cfg.auto_augment)
    )
    samples = len(ours_ds) // cfg.loader_batch_size * cfg.loader_batch_size
    cpu_transform = partial(ours_ds.transform, device=torch.device("cpu"), dtype=torch.float32)

    def ours(workers: int) -> DataLoader:
        sampler = EpochKeys(DistributedSampler(ours_ds, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed))
        return make_loader(ours_ds, cfg.loader_batch_size, sampler, workers, drop_last=True)

    def before(workers: int) -> DataLoader:
        dataset = PerSampleFloatDataset(str(prepared), "train", augment=True, seed=cfg.seed)
        return DataLoader(
            dataset, cfg.loader_batch_size, shuffle=True, num_workers=workers, persistent_workers=True, drop_last=True
        )

    # label -> (a loader of N processes, the batch transform run in this process, samples a pass)
    loaders = {"ours_uint8": (ours, None, samples)}
    if not encoded:
        loaders["ours_plus_cpu_transform"] = (ours, cpu_transform, samples)
        if cfg.auto_augment is None:
            loaders["per_sample_float_before"] = (before, None, samples)
    loaders["torchvision_imagefolder_pil"] = (
        partial(torchvision_loader, str(images), side, encoded, cfg.loader_batch_size, policy=cfg.auto_augment),
        None,
        cfg.num_images,
    )
    figures: dict[str, dict[str, Any]] = {}
    for label, (make, transform, count) in loaders.items():
        for workers in cfg.loader_workers:
            # Built here and dropped after: its persistent processes end before the next loader's start.
            walls, cpus = measure_passes(make(workers), cfg.repeats, transform)
            figure = figures.setdefault(label, {})[str(workers)] = rates(walls, cpus, count, workers)
            print(
                f"bench data: {name} {label} {workers} process(es): {figure['samples_per_second']['median']:.0f} "
                "samples/s, "
                f"{figure['samples_per_cpu_second']['median']:.0f} per CPU second",
                flush=True,
            )
    stored = sum(len(ours_ds.stored(i)) for i in range(len(ours_ds))) / len(ours_ds)
    return {
        "image_size": side,
        "encoded": encoded,
        "train_images": len(ours_ds),
        "stored_bytes_per_image": stored,
        "loaders": figures,
    }


def ratios(cases: dict[str, Any], figure: str) -> dict[str, dict[str, float]]:
    """The acceptance figures, per process count, from the medians of ``figure`` (``per_process``
    or ``samples_per_cpu_second``): ours over the per-sample path (raw 224), with and without the
    batch transform on the CPU, and ours over torchvision (encoded); those of the loaders measured."""

    def ratio(case: str, ours: str, peer: str) -> dict[str, float]:
        loaders = cases[case]["loaders"]
        return {
            workers: loaders[ours][workers][figure]["median"] / loaders[peer][workers][figure]["median"]
            for workers in loaders[ours]
        }

    wanted = {  # ratio name -> (case, ours, peer); a ratio of a case not measured is left out
        "raw_224_ours_over_per_sample_float": ("raw_224", "ours_uint8", "per_sample_float_before"),
        "raw_224_ours_with_cpu_transform_over_per_sample_float": (
            "raw_224",
            "ours_plus_cpu_transform",
            "per_sample_float_before",
        ),
        "encoded_224_ours_over_torchvision": ("encoded_jpeg_224", "ours_uint8", "torchvision_imagefolder_pil"),
    }
    return {name: ratio(*of) for name, of in wanted.items() if of[0] in cases and of[2] in cases[of[0]]["loaders"]}


# -- the pipeline input case: the run loop fed by the driver (before) vs read by the stages (after) --


def run_bench_data(cfg: BenchDataConfig) -> dict[str, Any]:
    """Measure every case of ``cfg.cases``, write results.json and the bar charts into ``cfg.out``."""
    started = time.perf_counter()
    host = machine()
    torch.set_num_threads(1)  # the batch transform on the CPU: one core, as one training process's share
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        for name in cfg.cases:
            measure = measure_pipeline_input if name == DATA_PIPELINE_CASE else measure_case
            cases[name] = measure(cfg, name, Path(scratch) / name)
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, case in cases.items():
        if name == DATA_PIPELINE_CASE:
            plots += pipeline_plots(out, name, case)
            continue
        labels, figures = [], []
        for label, by_workers in case["loaders"].items():
            for workers, figure in by_workers.items():
                labels.append(f"{label.replace('_', ' ')}\n{workers} process(es)")
                figures.append(figure["per_process"])
        plot = out / f"{name}_per_process.png"
        policy = f", auto-augment {cfg.auto_augment}" if cfg.auto_augment else ""
        title = f"{name}: loader samples/s per loader process, batch {cfg.loader_batch_size}{policy}"
        bar_chart(plot, labels, figures, "samples per second per loader process", title)
        plots.append(str(plot))
    results = {
        "benchmark": "data",
        "machine": host,
        "settings": {
            "cases": list(cfg.cases),
            "num_images": cfg.num_images,
            "loader_batch_size": cfg.loader_batch_size,
            "loader_workers": list(cfg.loader_workers),
            "repeats": cfg.repeats,
            "seed": cfg.seed,
            "auto_augment": cfg.auto_augment,
            **(
                {
                    "pipeline_steps": cfg.pipeline_steps,
                    "pipeline_warmup": cfg.pipeline_warmup,
                    "pipeline_batch_size": cfg.pipeline_batch_size,
                    "pipeline_microbatches": cfg.pipeline_microbatches,
                    "pipeline_loader_workers": cfg.pipeline_loader_workers,
                }
                if DATA_PIPELINE_CASE in cases
                else {}
            ),
        },
        "cases": cases,
        "ratios": {figure: ratios(cases, figure) for figure in ("per_process", "samples_per_cpu_second")},
        "elapsed_seconds": time.perf_counter() - started,
    }
    path = write_results(out, results)
    summary = {"results": str(path), "plots": plots, "ratios": results["ratios"]}
    if DATA_PIPELINE_CASE in cases:
        summary["pipeline_input_after_over_before"] = cases[DATA_PIPELINE_CASE]["after_over_before"]
    return summary
