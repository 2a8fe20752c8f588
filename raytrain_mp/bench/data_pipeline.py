"""``raytrain-mp bench data``'s pipeline case, ``pipeline_input_jpeg_224``: who reads the batches of
the pipeline run loop, the driver or the first stage's loader processes.

Job: the pipeline run loop (issue #33) on encoded 224x224 JPEGs, augmented, with a model whose
step takes milliseconds (``tiny_convnet``, 2 stages on CPUs), side by side in one run: before, the
driver reads each batch (``ParquetImageDataset.batch`` and the batch transform, in this process)
and sends stage 0 the model inputs (``PipelineTrainer.train_steps``, one step a call, the next
batch read while the stages compute); after, stage 0's loader processes read them (``StageData``
with ``--pipeline-loader-workers``, ``train_data_steps``) and the driver sends positions. Per
pass: end-to-end samples/s, and the driver's CPU seconds per trained sample from
``time.process_time()`` (every thread of this process, Ray's own included, and no child process:
what the driver itself spends, its in-process reads before included; the main thread's share is
reported beside it). Two bar charts.

Invariants: before and after train the same model from the same weights on the same samples with
the same augmentation (seed ``--seed``, ``feed.epoch_batches`` order, position (epoch, step) for
both): an untimed warm-up of ``--pipeline-warmup`` steps of epoch 0, then ``--repeats`` timed
passes of ``--pipeline-steps`` steps, pass r the first steps of epoch r + 1 (the case makes enough
images for that), so each pass starts an epoch for both alike and their losses agree step by step
(``same_samples``); before runs all its passes, then after, each on its own trainer. It runs on
the Ray this process is connected to, else on a local Ray of its own with a CPU for each stage and
loader process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrain_mp.bench.common import bar_chart, summarize
from raytrain_mp.bench.config import BenchDataConfig
from raytrain_mp.bench.data_images import VAL_FRACTION, make_images
from raytrain_mp.data import ParquetImageDataset
from raytrain_mp.data.prepare import prepare

PIPELINE_SIDE = 224  # the pipeline case's model input: the encoded JPEGs decoded with the ImageNet recipe
PIPELINE_LR = 0.05  # passed with every step, as the run loop passes its schedule's rate


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
    from raytrain_mp.ray_logs import quiet_ray_train_logs, silence_harmless_notices

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
