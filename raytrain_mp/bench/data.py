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

And, only when ``--cases`` names it, ``pipeline_input_jpeg_224``: the pipeline run loop (issue
#33) on encoded 224x224 JPEGs, augmented, with a model whose step takes milliseconds
(``tiny_convnet``, 2 stages on CPUs), side by side in one run: before, the driver reads each batch
(``ParquetImageDataset.batch`` and the batch transform, in this process) and sends stage 0 the
model inputs (``PipelineTrainer.train_steps``, one step a call, the next batch read while the
stages compute); after, stage 0's loader processes read them (``StageData`` with
``--pipeline-loader-workers``, ``train_data_steps``) and the driver sends positions. Per pass:
end-to-end samples/s, and the driver's CPU seconds per trained sample from ``time.process_time()``
(every thread of this process, Ray's own included, and no child process: what the driver itself
spends, its in-process reads before included; the main thread's share is reported beside it).

Invariants: every loader of a case reads the same images (cut from scikit-learn's two bundled
photos, seeded), with the same batch size and process count; loader processes are persistent and
one untimed pass over the images starts them and warms the page cache, so a figure is the median
(and min, max) of ``--repeats`` timed passes; per process figures are the figures divided by the
process count. Beside wall-clock samples/s, every figure has its samples per CPU second (all
processes of the loader, this one included): on a shared machine the wall clock measures the
neighbours too, CPU time only what the loader itself spent. The pipeline case's before and after
train the same model from the same weights on the same samples with the same augmentation (seed
``--seed``, ``feed.epoch_batches`` order, position (epoch, step) for both): an untimed warm-up of
``--pipeline-warmup`` steps of epoch 0, then ``--repeats`` timed passes of ``--pipeline-steps``
steps, pass r the first steps of epoch r + 1 (the case makes enough images for that), so each pass
starts an epoch for both alike and their losses agree step by step (``same_samples``); before runs
all its passes, then after, each on its own trainer. It runs on the Ray this process is connected
to, else on a local Ray of its own with a CPU for each stage and loader process. Writes
``results.json`` and one bar chart per loader case, two for the pipeline case.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_mp.bench.common import bar_chart, machine, summarize, write_results
from raytrain_mp.bench.config import DATA_PIPELINE_CASE, BenchDataConfig
from raytrain_mp.bench.data_peers import PerSampleFloatDataset, torchvision_loader
from raytrain_mp.data import ParquetImageDataset
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.data.prepare import prepare

CASES = {  # loader case name -> (side in pixels, encoded)
    "raw_32": (32, False),
    "raw_224": (224, False),
    "encoded_jpeg_224": (224, True),
}
VAL_FRACTION = 0.05  # of every case's images, as prepare splits them: round(count * VAL_FRACTION) to val
PIPELINE_SIDE = 224  # the pipeline case's model input: the encoded JPEGs decoded with the ImageNet recipe
PIPELINE_LR = 0.05  # passed with every step, as the run loop passes its schedule's rate
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
    prepare(f"imagefolder:{images}", prepared, val_fraction=VAL_FRACTION, seed=cfg.seed, **options)
    ours_ds = ParquetImageDataset(str(prepared), "train", augment=True, seed=cfg.seed)
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
        loaders["per_sample_float_before"] = (before, None, samples)
    loaders["torchvision_imagefolder_pil"] = (
        partial(torchvision_loader, str(images), side, encoded, cfg.loader_batch_size),
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
    batch transform on the CPU, and ours over torchvision (encoded); those of the loader cases measured."""

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
    return {name: ratio(*of) for name, of in wanted.items() if of[0] in cases}


# -- the pipeline input case: the run loop fed by the driver (before) vs read by the stages (after) --


def tiny_convnet(num_classes: int) -> nn.Module:
    """A model whose step takes milliseconds on 224x224 inputs, so the input, not the math, sets the pace."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 4, stride=4),
        nn.ReLU(),
        nn.Conv2d(8, 8, 4, stride=4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def pipeline_image_count(cfg: BenchDataConfig) -> int:
    """``--num-images``, or the fewest images whose train split holds a whole pass (and the warm-up)
    in one epoch: every pass then starts an epoch of its own."""
    need = max(cfg.pipeline_steps, cfg.pipeline_warmup) * cfg.pipeline_batch_size
    count = cfg.num_images
    while count - int(round(count * VAL_FRACTION)) < need:
        count += 1
    return count


@contextmanager
def ray_with_cpus(cpus: int) -> Iterator[None]:
    """The Ray this process is connected to, else a new local one of its own (never one another
    process started) with at least ``cpus`` logical CPUs, stopped afterwards."""
    import ray

    if ray.is_initialized():
        yield
        return
    from raytrain_mp.cluster import quiet_ray_train_logs, silence_harmless_notices

    quiet_ray_train_logs()
    silence_harmless_notices()
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, cpus), include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def main_thread_cpu() -> float | None:
    """CPU seconds of this process's main thread (Linux), where the run loop, the driver's reads
    (before) and the Ray calls' submission run; the rest of the process's CPU is Ray's own threads."""
    stat = Path(f"/proc/self/task/{threading.main_thread().native_id}/schedstat")
    return int(stat.read_text().split()[0]) / 1e9 if stat.is_file() else None


def timed_passes(
    run: Callable[[list[tuple[int, int]]], list[float]], cfg: BenchDataConfig
) -> tuple[dict[str, Any], list[float]]:
    """One untimed pass of ``--pipeline-warmup`` steps (epoch 0), then ``--repeats`` timed passes
    of ``--pipeline-steps`` steps, pass r the first steps of epoch r + 1; ``run`` trains the given
    (epoch, step) positions and returns their losses. The figures per pass, and every loss."""
    losses = run([(0, step) for step in range(cfg.pipeline_warmup)]) if cfg.pipeline_warmup else []
    samples = cfg.pipeline_steps * cfg.pipeline_batch_size
    walls, cpus, mains = [], [], []
    for r in range(cfg.repeats):
        positions = [(r + 1, step) for step in range(cfg.pipeline_steps)]
        main, cpu, wall = main_thread_cpu(), time.process_time(), time.perf_counter()
        losses += run(positions)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        if main is not None:
            mains.append(main_thread_cpu() - main)
    figures = {
        "samples_per_second": summarize([samples / w for w in walls]),
        "driver_cpu_seconds_per_sample": summarize([c / samples for c in cpus]),
        "driver_cores_busy": summarize([c / w for c, w in zip(cpus, walls)]),
        "wall_seconds": summarize(walls),
    }
    if mains:
        figures["driver_main_thread_cpu_seconds_per_sample"] = summarize([c / samples for c in mains])
    figures["timed_steps"] = cfg.repeats * cfg.pipeline_steps
    figures["timed_samples"] = cfg.repeats * samples
    figures["warmup_steps"] = cfg.pipeline_warmup
    return figures, losses


def measure_pipeline_input(cfg: BenchDataConfig, name: str, root: Path) -> dict[str, Any]:
    """The pipeline run loop on encoded 224x224 JPEGs (augmented), a 2-stage ``tiny_convnet`` on
    CPUs: before, the driver reads each batch and sends stage 0 its model inputs
    (``PipelineTrainer.train_steps``, one step a call, the next batch read while the stages
    compute); after, stage 0's loader processes read them (``StageData``, ``train_data_steps``) and
    the driver sends positions. Both train the same model from the same weights on the same
    samples, so their losses agree step by step (``same_samples``)."""
    from raytrain_mp.pipeline.blocks import flatten_model
    from raytrain_mp.pipeline.feed import StageData, epoch_batches
    from raytrain_mp.pipeline.trainer import PipelineTrainer

    count = pipeline_image_count(cfg)
    images = make_images(root / "images", count, None, cfg.seed)
    prepared = root / "prepared"
    meta = prepare(
        f"imagefolder:{images}",
        prepared,
        val_fraction=VAL_FRACTION,
        seed=cfg.seed,
        encoded=True,
        image_size=PIPELINE_SIDE,
    )
    batch, m, workers = cfg.pipeline_batch_size, cfg.pipeline_microbatches, cfg.pipeline_loader_workers
    if meta.counts["train"] // batch < max(cfg.pipeline_steps, cfg.pipeline_warmup):
        raise RuntimeError(
            f"{name}: {meta.counts['train']} train images hold fewer than a pass of {cfg.pipeline_steps} steps of "
            f"{batch}"
        )
    torch.manual_seed(cfg.seed)
    model = tiny_convnet(meta.num_classes)
    cut = [flatten_model(model, None)[1].name]  # stage 0: the first conv; stage 1: the rest
    options = dict(
        num_microbatches=m,
        split_points=cut,
        use_gpu=False,
        memory_format="contiguous",
        lr=PIPELINE_LR,
        cpus_per_stage=1,
    )

    # Before: the run loop of before issue #33, the driver's reads in this process.
    train_ds = ParquetImageDataset(str(prepared), "train", augment=True, seed=cfg.seed, meta=meta)
    to_input = partial(train_ds.transform, device=torch.device("cpu"), dtype=torch.float32)

    def driver_batches(positions: Sequence[tuple[int, int]]) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        orders: dict[int, list[torch.Tensor]] = {}
        for epoch, step in positions:
            order = orders.setdefault(epoch, epoch_batches(len(train_ds), batch, cfg.seed, epoch))
            images_, labels, params = train_ds.batch((epoch, int(i)) for i in order[step])
            yield to_input(images_, params), labels, PIPELINE_LR

    runs: dict[str, dict[str, Any]] = {}
    losses: dict[str, list[float]] = {}
    with ray_with_cpus(2 + workers):  # the after layout's bundles: stage 0 plus its loaders, stage 1
        with PipelineTrainer(model, 2, **options) as trainer:
            runs["driver_reads"], losses["driver_reads"] = timed_passes(
                lambda positions: list(trainer.train_steps(driver_batches(positions), steps_per_call=1)), cfg
            )
        data = StageData(str(prepared), batch, cfg.seed, augment=True, loader_workers=workers)
        with PipelineTrainer(model, 2, **options, data=data) as trainer:
            runs["stage_loaders"], losses["stage_loaders"] = timed_passes(
                lambda positions: list(
                    trainer.train_data_steps(((e, s, PIPELINE_LR) for e, s in positions), steps_per_call=1)
                ),
                cfg,
            )
            reads = trainer.reads()
        runs["stage_loaders"]["stage_reads"] = reads
    before, after = runs["driver_reads"], runs["stage_loaders"]
    ratio = {
        figure: after[figure]["median"] / before[figure]["median"]
        for figure in (
            "samples_per_second",
            "driver_cpu_seconds_per_sample",
            "driver_main_thread_cpu_seconds_per_sample",
        )
        if figure in before
    }
    print(
        f"bench data: {name} samples/s {before['samples_per_second']['median']:.0f} before, "
        f"{after['samples_per_second']['median']:.0f} after; "
        f"driver CPU s/sample after/before {ratio['driver_cpu_seconds_per_sample']:.3f}",
        flush=True,
    )
    difference = max(abs(a - b) for a, b in zip(losses["driver_reads"], losses["stage_loaders"]))
    return {
        "image_size": PIPELINE_SIDE,
        "encoded": True,
        "images": count,
        "train_images": meta.counts["train"],
        "model": "tiny_convnet: conv 4/4 (8) | conv 4/4 (8), pool, linear; 2 stages, CPU, contiguous",
        "batch_size": batch,
        "microbatches": m,
        "loader_workers": workers,
        "driver_cpu_clock": (
            "time.process_time(): every thread of this process (the run loop and Ray's own), no child process"
        ),
        "runs": runs,
        "after_over_before": ratio,
        "same_samples": {"steps_compared": len(losses["driver_reads"]), "max_loss_difference": difference},
        "acceptance": {
            "driver_cpu_per_sample_under_5_percent": ratio["driver_cpu_seconds_per_sample"] < 0.05,
            "samples_per_second_not_lower": ratio["samples_per_second"] >= 1.0,
        },
    }


def pipeline_plots(out: Path, name: str, case: dict[str, Any]) -> list[str]:
    """Two bar charts, before and after: samples/s, and the driver's CPU milliseconds per sample."""
    labels = ["before: the driver reads", f"after: stage loaders ({case['loader_workers']} process(es))"]
    runs = [case["runs"]["driver_reads"], case["runs"]["stage_loaders"]]
    setting = f"batch {case['batch_size']}, m={case['microbatches']}"
    speed = out / f"{name}_samples_per_second.png"
    ratio = case["after_over_before"]
    bar_chart(
        speed,
        labels,
        [r["samples_per_second"] for r in runs],
        "samples per second, end to end",
        f"{name}: pipeline run loop\n{setting}; after/before {ratio['samples_per_second']:.2f}",
    )
    cpu = out / f"{name}_driver_cpu_per_sample.png"
    in_ms = [{k: v * 1e3 for k, v in r["driver_cpu_seconds_per_sample"].items()} for r in runs]
    bar_chart(
        cpu,
        labels,
        in_ms,
        "driver CPU milliseconds per trained sample",
        f"{name}: driver CPU per trained sample\n{setting}; after/before {ratio['driver_cpu_seconds_per_sample']:.3f}",
    )
    return [str(speed), str(cpu)]


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
        title = f"{name}: loader samples/s per loader process, batch {cfg.loader_batch_size}"
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
