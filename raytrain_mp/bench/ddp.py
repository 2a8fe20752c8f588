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

On GPUs (``--use-gpu``, the default where this machine has one for each worker of the largest
count) every rank has its own GPU, and with 2 or more GPUs ``nn.DataParallel`` (the seeds'
baseline: one process, the batch scattered over the GPUs, outputs gathered on GPU 0) runs the same
per-GPU batch; its figure holds the peak memory of each GPU, where GPU 0's extra shows.

Invariants:
- Both sides see the same model, seed, per-worker batch, thread count and in-memory data.
- ``--rounds`` runs every side that many times in turn, and each side's timed steps of all rounds
  are pooled (``bench.common.pooled``, each round's median kept): the sides alternate within
  minutes, so a shared machine's drift hits them alike. Start-up and first-step seconds are the
  first round's (the compiled sides' cold ones).
- In each round the bare runs go first, before the round starts Ray, so Ray's idle daemons do not
  share the CPUs with them (``ray_running_during_bare`` says whether Ray was already up, as in tests).
- Start-up is the wall time from launching (``fit()`` / starting torchrun) to the first step;
  throughput never includes it.
- No variant asks for more GPUs than exist: one that would is listed under ``skipped`` with the
  reason. The one-process references run in a child process that exits before the measured runs,
  so no CUDA context or cached memory of theirs stays on a GPU the ranks use.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_mp.bench.common import (
    bar_chart,
    bench_use_gpu,
    in_fresh_process,
    machine,
    pooled,
    summarize,
    torchrun,
    write_results,
)
from raytrain_mp.bench.config import BenchDDPConfig
from raytrain_mp.compilation import CompileWatch, use_cache
from raytrain_mp.ddp.distributed_eval import global_count
from raytrain_mp.ddp.execution import prepare_runner
from raytrain_mp.ddp.sync_batchnorm import convert_sync_batchnorm
from raytrain_mp.errors import UsageError
from raytrain_mp.models import build_model, check_model
from raytrain_mp.niceness import run_at_normal_niceness
from raytrain_mp.optim import build_optimizer

DISTINCT_BATCHES = 4  # in-memory batches each worker cycles through
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4  # raytrain-mp ddp's defaults


def measure_steps(
    settings: dict[str, Any], rank: int, world: int, device: torch.device, data_parallel_gpus: int = 0
) -> dict[str, Any]:
    """Run warm-up and timed DDP steps (plain steps without a process group; ``nn.DataParallel``
    over GPUs 0..``data_parallel_gpus``-1 when that is 2 or more, each GPU a worker's batch); the
    rank's figures.

    Returns plain values (Ray Train's report wants them): ``step_seconds``, each timed step's,
    ``first_step_at``, the wall-clock time (``time.time()``) at which the first step started, and
    on CUDA ``peak_memory_bytes`` of the rank's GPU (of each GPU, a list, under DataParallel)."""
    torch.set_num_threads(settings["cpus_per_worker"])  # Ray and torchrun set OMP_NUM_THREADS; torch's pool is ours
    size, batch = settings["image_size"], settings["batch_size_per_worker"]
    torch.manual_seed(settings["seed"])
    model: nn.Module = build_model(
        settings["model"], settings["num_classes"], 3, settings["small_stem"], image_size=size
    )
    started = time.perf_counter()  # the first step's seconds count from here: what compiling takes
    watch = CompileWatch.start()
    distributed = dist.is_available() and dist.is_initialized()
    if settings["sync_bn"] and world > 1:
        model = convert_sync_batchnorm(model, device=device)
    model.to(device)
    gpus = [device.index] if device.type == "cuda" else []
    if distributed:
        model = distributed_model(model, settings, device, gpus, (batch, 3, size, size))
    elif data_parallel_gpus >= 2:
        gpus = list(range(data_parallel_gpus))
        model = nn.DataParallel(model, device_ids=gpus)
        batch *= data_parallel_gpus
    optimizer = build_optimizer(model.parameters(), "sgd", settings["lr"], MOMENTUM, WEIGHT_DECAY)
    data = torch.Generator().manual_seed(settings["seed"] * 1000 + rank)
    batches = [
        (
            torch.randn(batch, 3, size, size, generator=data),
            torch.randint(settings["num_classes"], (batch,), generator=data),
        )
        for _ in range(DISTINCT_BATCHES)
    ]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        # the DDP loop's step: the global sample count is all-reduced, the loss is a sum scaled by
        # world / count because DDP averages gradients over ranks.
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        scale = world / global_count(len(y), device)
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
        (loss * scale.to(loss.dtype)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for gpu in gpus:
            torch.cuda.synchronize(gpu)

    first_step_at = time.time()
    seconds = []
    for i in range(settings["warmup"] + settings["steps"]):
        start = time.perf_counter()
        step(*batches[i % DISTINCT_BATCHES])
        if i == 0:
            first_step_seconds = time.perf_counter() - started
            graphs_from_cache, graphs_compiled = watch.since()
        if i >= settings["warmup"]:
            seconds.append(time.perf_counter() - start)
    figures: dict[str, Any] = {
        "step_seconds": seconds,
        "first_step_at": first_step_at,
        "first_step_seconds": first_step_seconds,
    }
    if settings.get("compiled"):  # what the first step read from the compile cache, and compiled
        figures |= {"graphs_from_cache": graphs_from_cache, "graphs_compiled": graphs_compiled}
    if gpus:
        memory = [torch.cuda.max_memory_allocated(gpu) for gpu in gpus]
        figures["peak_memory_bytes"] = memory if data_parallel_gpus >= 2 else memory[0]
    return figures


def distributed_model(
    model: nn.Module, settings: dict[str, Any], device: torch.device, gpus: list[int], sample_shape: tuple[int, ...]
) -> nn.Module:
    """DDP over ``model`` as the side runs it (``settings["compiled"]``): None, eager; "ours", as
    ``raytrain-mp ddp --compile`` runs it (``ddp.execution.prepare_runner``: the model compiled,
    DDP over it); "torch", as a torchrun script compiles (``torch.compile(DDP(model))``: dynamo's
    DDPOptimizer cuts the graph at DDP's gradient buckets, so that their all-reduce overlaps the
    backward). Compiled into ``settings["compile_cache"]``."""
    compiled = settings["compiled"]
    options = {"device_ids": gpus or None, "bucket_cap_mb": settings["bucket_cap_mb"]}
    if compiled == "ours":
        run = SimpleNamespace(
            compile=True,
            compile_mode=settings["compile_mode"],
            compile_cache=settings["compile_cache"],
            memory_format="contiguous",  # the torchrun side's layout
            precision="fp32",
        )
        runner, _ = prepare_runner(run, model, sample_shape, torch.float32, device, None)
        return DistributedDataParallel(runner, **options)
    ddp = DistributedDataParallel(model, **options)
    if compiled == "torch":
        use_cache(settings["compile_cache"])
        return torch.compile(ddp, mode=settings["compile_mode"])
    return ddp


def throughput(figures: dict[str, Any], samples_per_step: int) -> dict[str, Any]:
    """Step seconds and samples/s of each timed step, summarized; the steps under ``samples`` (so
    that ``bench.common.pooled`` pools rounds)."""
    samples = {
        "step_seconds": figures["step_seconds"],
        "samples_per_second": [samples_per_step / seconds for seconds in figures["step_seconds"]],
    }
    return {
        **{
            key: figures[key]
            for key in ("first_step_seconds", "graphs_from_cache", "graphs_compiled")
            if key in figures
        },
        **{figure: summarize(values) for figure, values in samples.items()},
        "samples": samples,
    }


def one_process(cfg: BenchDDPConfig, threads: int, data_parallel_gpus: int = 0) -> dict[str, Any]:
    """One process without DDP, ``threads`` threads: the reference (one worker's batch, on GPU 0
    with ``--use-gpu``), or ``nn.DataParallel`` over ``data_parallel_gpus`` GPUs (one worker's
    batch per GPU). Run it in a fresh process (``in_fresh_process``): it sets torch's threads."""
    device = torch.device("cuda", 0) if cfg.use_gpu else torch.device("cpu")
    figures = measure_steps({**cfg.settings(), "cpus_per_worker": threads}, 0, 1, device, data_parallel_gpus)
    memory = {"peak_memory_bytes": figures["peak_memory_bytes"]} if "peak_memory_bytes" in figures else {}
    return {
        "threads": threads,
        "device": str(device),
        **throughput(figures, cfg.batch_size_per_worker * max(1, data_parallel_gpus)),
        **memory,
    }


def bare(cfg: BenchDDPConfig, workers: int, compiled: str | None = None, cache: str | None = None) -> dict[str, Any]:
    """``workers`` ranks of ``bench.ddp_bare`` under torchrun (``compiled``: see ``distributed_model``)."""
    launched = time.time()
    settings = cfg.settings(compiled, cache)
    what = f"torchrun with {workers} workers"
    figures = torchrun("raytrain_mp.bench.ddp_bare", workers, settings, cfg.cpus_per_worker, what)
    return {
        "workers": workers,
        "startup_seconds": figures["first_step_at"] - launched,
        **throughput(figures, workers * cfg.batch_size_per_worker),
    }


def ray_worker(settings: dict[str, Any]) -> None:
    """The Ray Train worker: the same steps, reported once (every rank reports; rank 0's is kept)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    run_at_normal_niceness()  # as ddp.loop does
    figures = measure_steps(settings, ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device())
    # Ray Train V2 keeps only metrics that come with a checkpoint, so rank 0 attaches a token one.
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "figures.json").write_text(json.dumps(figures))
        checkpoint = ray.train.Checkpoint.from_directory(folder) if ctx.get_world_rank() == 0 else None
        ray.train.report(figures, checkpoint=checkpoint)


def ours(
    cfg: BenchDDPConfig, workers: int, storage: str, compiled: str | None = None, cache: str | None = None
) -> dict[str, Any]:
    """``workers`` Ray Train workers, configured as ``ddp.trainer.build_trainer`` configures them."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_mp.cluster import check_fits
    from raytrain_mp.train_logs import run_config_logging

    check_fits("--num-workers", workers, cfg.cpus_per_worker, 1 if cfg.use_gpu else 0)
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config=cfg.settings(compiled, cache),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=cfg.use_gpu,
            resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})},
        ),
        run_config=RunConfig(
            name=f"bench-ddp-{workers}-{time.strftime('%H%M%S')}",
            storage_path=storage,
            **run_config_logging(cfg.verbose),
        ),
    )
    launched = time.time()
    figures = trainer.fit().metrics
    return {
        "workers": workers,
        "startup_seconds": figures["first_step_at"] - launched,
        **throughput(figures, workers * cfg.batch_size_per_worker),
    }


def too_few_gpus(cfg: BenchDDPConfig, workers: int, gpus: float, where: str) -> str | None:
    """Why ``workers`` ranks cannot run where ``gpus`` GPUs exist (one each), or None when they can."""
    if cfg.use_gpu and workers > gpus:
        return f"{workers} workers need {workers} GPUs (one each); {where} has {gpus:g}"
    return None


def measured(
    cfg: BenchDDPConfig,
    side: str,
    gpus: float,
    where: str,
    run: Callable[[int], dict[str, Any]],
    skipped: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """``run(w)`` for each worker count that fits ``gpus``; the others appended to ``skipped``."""
    runs = []
    for workers in cfg.num_workers:
        reason = too_few_gpus(cfg, workers, gpus, where)
        if reason:
            skipped.append({"variant": side, "workers": workers, "reason": reason})
            print(f"{side} with {workers} workers: skipped, {reason}", flush=True)
        else:
            runs.append(run(workers))
    return runs


def data_parallel(cfg: BenchDDPConfig, threads: int, skipped: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``nn.DataParallel`` over as many GPUs as the largest worker count (2 or more), or None
    with the reason appended to ``skipped``."""
    gpus = min(torch.cuda.device_count(), max(cfg.num_workers)) if cfg.use_gpu else 0
    if gpus >= 2:
        return {"gpus": gpus, **in_fresh_process(one_process, cfg, threads, gpus)}
    reason = (
        "nn.DataParallel runs on CUDA GPUs; this run is on CPUs (--no-use-gpu or no GPU for each worker)"
        if not cfg.use_gpu
        else f"nn.DataParallel needs 2 or more GPUs and a worker count of 2 or more; this machine has "
        f"{torch.cuda.device_count()}, the largest count is {max(cfg.num_workers)}"
    )
    skipped.append({"variant": "data_parallel", "reason": reason})
    return None


def one_round(cfg: BenchDDPConfig, caches: str, skipped: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each side's runs once, torchrun's first, before this round starts Ray (unless connected):
    eager, then (``--compile``) compiled into a cache of the side's own in ``caches``, ours twice,
    the second on the cache the first filled (the first round's: cold, then as a restart)."""
    from raytrain_mp.cluster import cluster_totals, ray_connection

    gpus = torch.cuda.device_count()
    sides = {"torchrun": measured(cfg, "torchrun", gpus, "this machine", lambda w: bare(cfg, w), skipped)}
    if cfg.compile:
        sides["torchrun_compiled"] = measured(
            cfg, "torchrun_compiled", gpus, "this machine", lambda w: bare(cfg, w, "torch", f"{caches}/t{w}"), skipped
        )
    with ray_connection(cfg.address, cfg.verbose), tempfile.TemporaryDirectory(prefix="bench-ddp-ray-") as storage:
        gpus, where = cluster_totals()[1], "the Ray cluster"
        sides["ray_train"] = measured(cfg, "ray_train", gpus, where, lambda w: ours(cfg, w, storage), skipped)
        for side in ("ray_train", "ray_train_warm") if cfg.compile else ():
            sides[f"{side}_compiled"] = measured(
                cfg, f"{side}_compiled", gpus, where, lambda w: ours(cfg, w, storage, "ours", f"{caches}/r{w}"), skipped
            )
    return sides


def run_bench_ddp(cfg: BenchDDPConfig) -> dict[str, Any]:
    """The references, then ``--rounds`` rounds of every side (``one_round``), each side's rounds
    pooled; write results.json and the plot."""
    import ray

    check_model(cfg.model, cfg.num_classes, 3, cfg.image_size, cfg.small_stem)  # before any process starts
    cfg = dataclasses.replace(cfg, use_gpu=bench_use_gpu(cfg.use_gpu, max(cfg.num_workers)))
    if cfg.use_gpu and not torch.cuda.is_available():
        raise UsageError(
            "--use-gpu: this machine has no CUDA GPU, and the references and the torchrun side run here; accepted: "
            "--no-use-gpu"
        )
    started = time.perf_counter()
    host = machine()
    ray_was_running = ray.is_initialized()
    threads = cfg.cpus_per_worker * max(cfg.num_workers)
    skipped: list[dict[str, Any]] = []
    reference = in_fresh_process(one_process, cfg, threads)
    dp = data_parallel(cfg, threads, skipped)
    with tempfile.TemporaryDirectory(prefix="bench-ddp-compile-") as caches:
        rounds = []
        for r in range(cfg.rounds):
            if cfg.rounds > 1:
                print(f"round {r + 1} of {cfg.rounds}", flush=True)
            rounds.append(one_round(cfg, caches, skipped if r == 0 else []))  # a skip is the same each round
    runs = {side: pooled([each[side] for each in rounds]) for side in rounds[0]}
    bare_runs, ray_runs = runs["torchrun"], runs["ray_train"]
    compiled = {side: runs[f"{side}_compiled"] for side in ("torchrun", "ray_train", "ray_train_warm") if cfg.compile}
    ratios = over(ray_runs, bare_runs)
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plot = out / "throughput_bars.png"
    device = "GPU" if cfg.use_gpu else f"{reference['threads']} threads"
    labels, figures = [f"one process\n{device}"], [reference["samples_per_second"]]
    if dp is not None:
        labels.append(f"nn.DataParallel\n{dp['gpus']} GPUs")
        figures.append(dp["samples_per_second"])
    sides = [("torchrun", bare_runs), ("Ray Train", ray_runs)]
    if cfg.compile:
        sides += [("torchrun compiled", compiled["torchrun"]), ("Ray Train compiled", compiled["ray_train"])]
    for side, runs in sides:
        labels += [f"{side}\n{r['workers']} worker(s)" for r in runs]
        figures += [r["samples_per_second"] for r in runs]
    per_worker = "1 GPU" if cfg.use_gpu else f"{cfg.cpus_per_worker} thread(s)"
    title = (
        f"{cfg.model} {cfg.image_size}x{cfg.image_size}, batch {cfg.batch_size_per_worker}/worker, {per_worker}/worker"
    )
    bar_chart(plot, labels, figures, "training samples per second", title)
    results = {
        "benchmark": "ddp",
        "machine": host,
        "settings": {**cfg.settings(), "num_workers": list(cfg.num_workers), "rounds": cfg.rounds},
        "ray_running_during_bare": ray_was_running,
        "one_process": reference,
        "data_parallel": dp,
        "bare_torchrun": bare_runs,
        "ray_train": ray_runs,
        "ours_over_bare": ratios,
        "ours_over_bare_by_round": over(ray_runs, bare_runs, by_round=True),
        **(compiled_figures(compiled, bare_runs, ray_runs) if cfg.compile else {}),
        "skipped": skipped,
        "elapsed_seconds": time.perf_counter() - started,
    }
    path = write_results(out, results)
    summary = {"results": str(path), "plots": [str(plot)], "ours_over_bare": ratios}
    return summary | {key: results[key] for key in COMPILED_RATIOS if key in results}


COMPILED_RATIOS = ("compiled_ours_over_bare_eager", "compiled_ours_over_bare_compiled")


def over(runs: list[dict[str, Any]], peers: list[dict[str, Any]], by_round: bool = False) -> dict[str, Any]:
    """Median samples/s of each of ``runs`` over the ``peers`` run of its worker count (pooled, or
    ``by_round``: a list, round by round, how far the pooled ratio moves with the machine's drift)."""
    by_workers = {peer["workers"]: peer for peer in peers}
    return {
        str(r["workers"]): [a / b for a, b in zip(medians(r), medians(by_workers[r["workers"]]), strict=True)]
        if by_round
        else r["samples_per_second"]["median"] / by_workers[r["workers"]]["samples_per_second"]["median"]
        for r in runs
        if r["workers"] in by_workers
    }


def medians(run: dict[str, Any]) -> list[float]:
    return run["round_medians"]["samples_per_second"]


def compiled_figures(
    compiled: dict[str, list[dict[str, Any]]], bare_runs: list[dict[str, Any]], ray_runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The compiled sides' runs, our compiled run over bare torchrun eager and compiled, and each
    side's first-step seconds (compiling, cold and warm, apart from the steady state)."""
    first_steps: dict[str, dict[str, float]] = {}
    sides = {"torchrun_eager": bare_runs, "ray_train_eager": ray_runs}
    sides |= {f"{side}_compiled": runs for side, runs in compiled.items()}
    for side, runs in sides.items():
        for run in runs:
            first_steps.setdefault(str(run["workers"]), {})[side] = run["first_step_seconds"]
    return {
        "bare_torchrun_compiled": compiled["torchrun"],
        "ray_train_compiled": compiled["ray_train"],
        "ray_train_compiled_warm": compiled["ray_train_warm"],
        "compiled_ours_over_bare_eager": over(compiled["ray_train"], bare_runs),
        "compiled_ours_over_bare_compiled": over(compiled["ray_train"], compiled["torchrun"]),
        "compiled_ours_over_bare_compiled_by_round": over(compiled["ray_train"], compiled["torchrun"], by_round=True),
        "compiled_ours_over_ours_eager": over(compiled["ray_train"], ray_runs),
        "first_step_seconds": first_steps,
    }
