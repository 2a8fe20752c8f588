"""``raytrain-mp bench ddp``: our Ray Train DDP loop against a bare torchrun loop, same work.

Job: measure steady-state training throughput (samples/s from the median step time after warm-up)
and start-up time of the same DDP training step launched two ways, for each worker count of
``--num-workers``: by Ray Train (``TorchTrainer``, what ``raytrain-mp ddp`` runs) and by torchrun
(``bench.ddp_bare``, the shape of the seeds' minimal DDP script); plus one plain process with all
the workers' threads as the reference. Writes ``results.json`` and a bar plot.

Why a benchmark loop rather than ``ddp.loop.train_loop_per_worker``: that loop reads Parquet
shards, evaluates and checkpoints every epoch, so its samples/s mixes data loading and I/O into
the figure. ``measure_steps`` mirrors its training step exactly (seeded model, optional
synchronized BatchNorm, DDP, the per-step all-reduce of the sample count, the sum loss scaled by
world / global count, SGD with momentum and the same weight-decay groups) on in-memory batches,
and both launchers run this one function, so the ratio ours/bare is the cost of the launcher and
its runtime alone.

Invariants:
- Both sides see the same model, seed, per-worker batch, thread count and in-memory data.
- The bare runs go first, before this command starts Ray, so Ray's idle daemons do not share the
  CPUs with them (``ray_running_during_bare`` says whether Ray was already up, as in tests).
- Start-up is the wall time from launching (``fit()`` / starting torchrun) to the first step;
  throughput never includes it.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_mp.bench.common import (
    bar_chart,
    machine,
    summarize,
    torchrun,
    write_results,
)
from raytrain_mp.bench.config import BenchDDPConfig
from raytrain_mp.ddp.distributed_eval import all_reduce_sum
from raytrain_mp.models import build_model, wants_small_stem
from raytrain_mp.optim import build_optimizer
from raytrain_mp.ddp.sync_batchnorm import convert_sync_batchnorm

DISTINCT_BATCHES = 4  # in-memory batches each worker cycles through
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4  # raytrain-mp ddp's defaults


def measure_steps(settings: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Run warm-up and timed DDP steps (plain steps without a process group); rank's figures.

    Returns plain numbers (Ray Train's report wants them): the median, min and max step seconds and
    ``first_step_at``, the wall-clock time (``time.time()``) at which the first step started."""
    torch.set_num_threads(settings["cpus_per_worker"])  # Ray and torchrun set OMP_NUM_THREADS; torch's pool is ours
    size, batch = settings["image_size"], settings["batch_size_per_worker"]
    torch.manual_seed(settings["seed"])
    small_stem = wants_small_stem(size) if settings["small_stem"] is None else settings["small_stem"]
    model: nn.Module = build_model(settings["model"], settings["num_classes"], 3, small_stem)
    distributed = dist.is_available() and dist.is_initialized()
    if settings["sync_bn"] and world > 1:
        model = convert_sync_batchnorm(model, device=device)
    model.to(device)
    if distributed:
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=settings["bucket_cap_mb"])
    optimizer = build_optimizer(model.parameters(), "sgd", settings["lr"], MOMENTUM, WEIGHT_DECAY)
    data = torch.Generator().manual_seed(settings["seed"] * 1000 + rank)
    batches = [
        (torch.randn(batch, 3, size, size, generator=data), torch.randint(settings["num_classes"], (batch,), generator=data))
        for _ in range(DISTINCT_BATCHES)
    ]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        # the DDP loop's step: the global sample count is all-reduced, the loss is a sum scaled by
        # world / count because DDP averages gradients over ranks.
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        (count,) = all_reduce_sum([float(len(y))], device)
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
        (loss * (world / count)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    first_step_at = time.time()
    seconds = []
    for i in range(settings["warmup"] + settings["steps"]):
        start = time.perf_counter()
        step(*batches[i % DISTINCT_BATCHES])
        if i >= settings["warmup"]:
            seconds.append(time.perf_counter() - start)
    return {**{f"step_{k}": v for k, v in summarize(seconds).items()}, "first_step_at": first_step_at}


def throughput(figures: dict[str, float], samples_per_step: int) -> dict[str, Any]:
    """samples/s from step seconds: median from the median step, min from the slowest, max from the fastest."""
    return {
        "step_seconds": {"median": figures["step_median"], "min": figures["step_min"], "max": figures["step_max"]},
        "samples_per_second": {
            "median": samples_per_step / figures["step_median"],
            "min": samples_per_step / figures["step_max"],
            "max": samples_per_step / figures["step_min"],
        },
    }


def one_process(cfg: BenchDDPConfig, threads: int) -> dict[str, Any]:
    """The reference: one plain process (no DDP) with ``threads`` threads, the same per-step batch."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    previous = torch.get_num_threads()
    try:
        figures = measure_steps({**cfg.settings(), "cpus_per_worker": threads}, 0, 1, device)
    finally:
        torch.set_num_threads(previous)
    return {"threads": threads, **throughput(figures, cfg.batch_size_per_worker)}


def bare(cfg: BenchDDPConfig, workers: int) -> dict[str, Any]:
    """``workers`` ranks of ``bench.ddp_bare`` under torchrun."""
    launched = time.time()
    figures = torchrun("raytrain_mp.bench.ddp_bare", workers, cfg.settings(), cfg.cpus_per_worker, f"torchrun with {workers} workers")
    return {"workers": workers, "startup_seconds": figures["first_step_at"] - launched, **throughput(figures, workers * cfg.batch_size_per_worker)}


def ray_worker(settings: dict[str, Any]) -> None:
    """The Ray Train worker: the same steps, reported once (every rank reports; rank 0's is kept)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    figures = measure_steps(settings, ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device())
    # Ray Train V2 keeps only metrics that come with a checkpoint, so rank 0 attaches a token one.
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "figures.json").write_text(json.dumps(figures))
        checkpoint = ray.train.Checkpoint.from_directory(folder) if ctx.get_world_rank() == 0 else None
        ray.train.report(figures, checkpoint=checkpoint)


def ours(cfg: BenchDDPConfig, workers: int, storage: str) -> dict[str, Any]:
    """``workers`` Ray Train workers, configured as ``ddp.trainer.build_trainer`` configures them."""
    from ray.train import LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_mp.cluster import check_fits, train_log_level

    use_gpu = torch.cuda.is_available()
    check_fits("--num-workers", workers, cfg.cpus_per_worker, 1 if use_gpu else 0)
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config=cfg.settings(),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        ),
        run_config=RunConfig(
            name=f"bench-ddp-{workers}-{time.strftime('%H%M%S')}",
            storage_path=storage,
            logging_config=LoggingConfig(log_level=train_log_level(cfg.verbose)),
        ),
    )
    launched = time.time()
    figures = trainer.fit().metrics
    return {"workers": workers, "startup_seconds": figures["first_step_at"] - launched, **throughput(figures, workers * cfg.batch_size_per_worker)}


def data_parallel_skipped() -> str | None:
    """Why ``nn.DataParallel`` is not measured here, or None when it could be."""
    if torch.cuda.device_count() < 2:
        return f"nn.DataParallel needs at least 2 CUDA GPUs; this machine has {torch.cuda.device_count()}"
    return "nn.DataParallel on CUDA is not implemented by this version of the benchmark"


def run_bench_ddp(cfg: BenchDDPConfig) -> dict[str, Any]:
    """Bare runs, then (starting Ray unless connected) Ray Train runs; write results.json and the plot."""
    import ray

    from raytrain_mp.cluster import ray_connection

    started = time.perf_counter()
    host = machine()
    ray_was_running = ray.is_initialized()
    reference = one_process(cfg, cfg.cpus_per_worker * max(cfg.num_workers))
    bare_runs = [bare(cfg, w) for w in cfg.num_workers]
    with ray_connection(cfg.address, cfg.verbose), tempfile.TemporaryDirectory(prefix="bench-ddp-ray-") as storage:
        ray_runs = [ours(cfg, w, storage) for w in cfg.num_workers]
    ratios = {
        str(b["workers"]): r["samples_per_second"]["median"] / b["samples_per_second"]["median"]
        for b, r in zip(bare_runs, ray_runs)
    }
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plot = out / "throughput_bars.png"
    labels = [f"one process\n{reference['threads']} threads"]
    figures = [reference["samples_per_second"]]
    for b, r in zip(bare_runs, ray_runs):
        labels += [f"torchrun\n{b['workers']} worker(s)", f"Ray Train\n{r['workers']} worker(s)"]
        figures += [b["samples_per_second"], r["samples_per_second"]]
    title = f"{cfg.model} {cfg.image_size}x{cfg.image_size}, batch {cfg.batch_size_per_worker}/worker, {cfg.cpus_per_worker} thread(s)/worker"
    bar_chart(plot, labels, figures, "training samples per second", title)
    results = {
        "benchmark": "ddp",
        "machine": host,
        "settings": {**cfg.settings(), "num_workers": list(cfg.num_workers)},
        "ray_running_during_bare": ray_was_running,
        "one_process": reference,
        "bare_torchrun": bare_runs,
        "ray_train": ray_runs,
        "ours_over_bare": ratios,
        "not_measured": {"data_parallel": data_parallel_skipped()},
        "elapsed_seconds": time.perf_counter() - started,
    }
    path = write_results(out, results)
    return {"results": str(path), "plots": [str(plot)], "ours_over_bare": ratios}
