"""``raytrain-mp bench data``: loader samples/s, ours against what users run today, same images.

Job: for three cases (32x32 raw pixels, CIFAR-like; 224x224 raw pixels; 224x224 JPEG files of
their own size, decoded with the ImageNet recipe), and for each loader process count of
``--loader-workers``, measure how many training samples per second a ``DataLoader`` delivers:

- ours: ``ParquetImageDataset`` (augmentation on) through ``data.loader``: uint8 batches plus
  augmentation parameters; normalization, crop and flip are left to the training device;
- ours plus the batch transform on this CPU (raw cases): the same batches made float32 model
  inputs by ``ParquetImageDataset.transform`` in this process, the per-core cost when the training
  device is the CPU;
- the per-sample float path it replaced (``bench.data_peers.PerSampleFloatDataset``, raw cases);
- torchvision's ``ImageFolder`` + PIL transforms + ``DataLoader`` over the same images as files
  (PNG for the raw cases, so the pixels are the same; the JPEG files themselves for the encoded one).

Invariants: every loader of a case reads the same images (cut from scikit-learn's two bundled
photos, seeded), with the same batch size and process count; loader processes are persistent and
one untimed pass over the images starts them and warms the page cache, so a figure is the median
(and min, max) of ``--repeats`` timed passes; per process figures are the figures divided by the
process count. Beside wall-clock samples/s, every figure has its samples per CPU second (all
processes of the loader, this one included): on a shared machine the wall clock measures the
neighbours too, CPU time only what the loader itself spent. Writes ``results.json`` and one bar
chart per case.
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_mp.bench.common import bar_chart, machine, summarize, write_results
from raytrain_mp.bench.config import BenchDataConfig
from raytrain_mp.bench.data_peers import PerSampleFloatDataset, torchvision_loader
from raytrain_mp.data import ParquetImageDataset
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.data.prepare import prepare

CASES = {  # name -> (side in pixels, encoded)
    "raw_32": (32, False),
    "raw_224": (224, False),
    "encoded_jpeg_224": (224, True),
}
JPEG_QUALITY = 90
ENCODED_SIDES = (256, 400)  # encoded case: each file's sides are drawn from this range, as photos vary
CPU_TICK = 0.01  # the resolution of cpu_times() without /proc: a shorter pass (tiny settings) counts one tick


def make_images(folder: Path, count: int, side: int | None, seed: int) -> Path:
    """An ImageFolder of ``count`` random crops of scikit-learn's sample photos in 2 classes (one per
    photo): PNG files of ``side`` x ``side`` when ``side`` is given, else JPEG files of random sizes."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    for i in range(count):
        label = i % len(photos)
        photo = photos[label]
        crop = int(rng.integers(160, min(photo.shape[:2]) + 1))
        top, left = (int(rng.integers(0, photo.shape[d] - crop + 1)) for d in (0, 1))
        image = Image.fromarray(photo[top : top + crop, left : left + crop])
        path = folder / f"photo{label}" / f"{i:05d}.{'png' if side else 'jpg'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if side:
            image.resize((side, side), Image.BILINEAR).save(path)
        else:
            w, h = (int(v) for v in rng.integers(*ENCODED_SIDES, size=2))
            image.resize((w, h), Image.BILINEAR).save(path, quality=JPEG_QUALITY)
    return folder


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
    prepare(f"imagefolder:{images}", prepared, val_fraction=0.05, seed=cfg.seed, **options)
    ours_ds = ParquetImageDataset(str(prepared), "train", augment=True, seed=cfg.seed)
    samples = len(ours_ds) // cfg.loader_batch_size * cfg.loader_batch_size
    cpu_transform = partial(ours_ds.transform, device=torch.device("cpu"), dtype=torch.float32)

    def ours(workers: int) -> DataLoader:
        sampler = EpochKeys(DistributedSampler(ours_ds, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed))
        return make_loader(ours_ds, cfg.loader_batch_size, sampler, workers, drop_last=True)

    def before(workers: int) -> DataLoader:
        dataset = PerSampleFloatDataset(str(prepared), "train", augment=True, seed=cfg.seed)
        return DataLoader(dataset, cfg.loader_batch_size, shuffle=True, num_workers=workers, persistent_workers=True, drop_last=True)

    # label -> (a loader of N processes, the batch transform run in this process, samples a pass)
    loaders = {"ours_uint8": (ours, None, samples)}
    if not encoded:
        loaders["ours_plus_cpu_transform"] = (ours, cpu_transform, samples)
        loaders["per_sample_float_before"] = (before, None, samples)
    loaders["torchvision_imagefolder_pil"] = (
        partial(torchvision_loader, str(images), side, encoded, cfg.loader_batch_size), None, cfg.num_images
    )
    figures: dict[str, dict[str, Any]] = {}
    for label, (make, transform, count) in loaders.items():
        for workers in cfg.loader_workers:
            # Built here and dropped after: its persistent processes end before the next loader's start.
            walls, cpus = measure_passes(make(workers), cfg.repeats, transform)
            figure = figures.setdefault(label, {})[str(workers)] = rates(walls, cpus, count, workers)
            print(f"bench data: {name} {label} {workers} process(es): {figure['samples_per_second']['median']:.0f} samples/s, "
                  f"{figure['samples_per_cpu_second']['median']:.0f} per CPU second", flush=True)  # fmt: skip
    stored = sum(len(ours_ds.stored(i)) for i in range(len(ours_ds))) / len(ours_ds)
    return {"image_size": side, "encoded": encoded, "train_images": len(ours_ds), "stored_bytes_per_image": stored, "loaders": figures}


def ratios(cases: dict[str, Any], figure: str) -> dict[str, dict[str, float]]:
    """The acceptance figures, per process count, from the medians of ``figure`` (``per_process``
    or ``samples_per_cpu_second``): ours over the per-sample path (raw 224), with and without the
    batch transform on the CPU, and ours over torchvision (encoded)."""

    def ratio(case: str, ours: str, peer: str) -> dict[str, float]:
        loaders = cases[case]["loaders"]
        return {
            workers: loaders[ours][workers][figure]["median"] / loaders[peer][workers][figure]["median"]
            for workers in loaders[ours]
        }

    return {
        "raw_224_ours_over_per_sample_float": ratio("raw_224", "ours_uint8", "per_sample_float_before"),
        "raw_224_ours_with_cpu_transform_over_per_sample_float": ratio("raw_224", "ours_plus_cpu_transform", "per_sample_float_before"),
        "encoded_224_ours_over_torchvision": ratio("encoded_jpeg_224", "ours_uint8", "torchvision_imagefolder_pil"),
    }


def run_bench_data(cfg: BenchDataConfig) -> dict[str, Any]:
    """Measure every case, write results.json and one bar chart per case into ``cfg.out``."""
    started = time.perf_counter()
    host = machine()
    torch.set_num_threads(1)  # the batch transform on the CPU: one core, as one training process's share
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        cases = {name: measure_case(cfg, name, Path(scratch) / name) for name in CASES}
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, case in cases.items():
        labels, figures = [], []
        for label, by_workers in case["loaders"].items():
            for workers, figure in by_workers.items():
                labels.append(f"{label.replace('_', ' ')}\n{workers} process(es)")
                figures.append(figure["per_process"])
        plot = out / f"{name}_per_process.png"
        title = f"{name}: loader samples/s per loader process, batch {cfg.loader_batch_size}"
        bar_chart(plot, labels, figures, "samples per second per loader process", title)
        plots.append(str(plot))
    results = {
        "benchmark": "data",
        "machine": host,
        "settings": {"num_images": cfg.num_images, "loader_batch_size": cfg.loader_batch_size,
                     "loader_workers": list(cfg.loader_workers), "repeats": cfg.repeats, "seed": cfg.seed},  # fmt: skip
        "cases": cases,
        "ratios": {figure: ratios(cases, figure) for figure in ("per_process", "samples_per_cpu_second")},
        "elapsed_seconds": time.perf_counter() - started,
    }
    path = write_results(out, results)
    return {"results": str(path), "plots": plots, "ratios": results["ratios"]}
