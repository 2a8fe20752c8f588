"""The native peer of ``raytrain-mp bench pipeline``, and ours against it on the layer3 split
(``results["native"]``, ``results["native_ours_layouts"]``).

Job: describe a case for the native ranks (``resnet_case``; the overhead case's is
``overhead.overhead_case``), run cases in ``bench.pipeline_native`` under torchrun, one rank per
stage with ``--cpus-per-stage`` threads (gloo on CPU, NCCL with a GPU per rank), the stages
wrapped in ``torch.distributed.pipelining.PipelineStage`` and run by ``ScheduleGPipe`` and
``Schedule1F1B`` over the same m as ours (a (schedule, m) the API refuses, such as 1F1B with m <
stages, is listed under ``skipped`` with the reason); and run ours and native on the layer3 split
``--resnet-rounds`` times in turn (ours, then native), each side's steps pooled
(``layer3_split_rounds``; ``round_medians`` per point). ``report`` turns these into
``summary.ours_over_native`` (per schedule and m, native median step seconds / ours on the seeds'
split; >1: ours is faster) and ``ours_over_native_by_round``.

Invariants:
- The native ranks build the same seeded model and batch (a case names its ``shared`` setup
  function and arguments) and the same stages (by block names), and build their model once; their
  first step of each (schedule, m), which infers the stage's shapes, is a warm-up step.
- A failing torchrun fails the benchmark (``RuntimeError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from raytrain_mp.bench.common import pooled, torchrun
from raytrain_mp.bench.config import BenchPipelineConfig
from raytrain_mp.bench.pipeline.layouts import layout_runs
from raytrain_mp.bench.pipeline.shared import Sweep, progress


def resnet_case(
    cfg: BenchPipelineConfig, plan: Sequence[dict[str, Any]], ours: Sequence[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The native ranks' ResNet case (plain values, it travels as JSON): the name and arguments of
    its seeded setup function, the stages' block names of ``plan`` and the sweep with its timing;
    given ``ours``' runs, the layout each of our stages computed in at each point (``layouts``,
    keyed "schedule m"), for the ranks to compute in too."""
    sweep = Sweep(
        "in our layouts, " if ours is not None else "",
        "s",
        ("gpipe", "1f1b"),
        tuple(sorted(cfg.microbatches)),
        cfg.warmup,
        cfg.steps,
    )
    layouts = (
        {}
        if ours is None
        else {"layouts": {f"{run['schedule']} {run['microbatches']}": run["memory_formats"] for run in ours}}
    )
    return {
        "setup": "seeded_setup",
        "arguments": {
            "model_name": cfg.model,
            "num_classes": cfg.num_classes,
            "image_size": cfg.image_size,
            "batch_size": cfg.global_batch_size,
            "seed": cfg.seed,
        },
        "chunk_blocks": {"1": [list(stage["blocks"]) for stage in plan]},
        "compile": cfg.compile,  # each rank's stage modules, as ours compiles them
        **layouts,
        **dataclasses.asdict(sweep),
    }


def native_runs(
    cfg: BenchPipelineConfig, cases: dict[str, dict[str, Any]], module: str = "raytrain_mp.bench.pipeline_native"
) -> dict[str, Any]:
    """The ``cases`` (``resnet_case``, ``overhead_case``) of ``torch.distributed.pipelining`` in one
    torchrun, one rank per stage, each rank running ``module`` (``bench.pipeline_native``, or what
    wraps its ``main``); raises ``RuntimeError`` when torchrun fails. The figures of each case by
    name, with what ran them (api, launcher, backend, device, world, threads)."""
    what = f"torch.distributed.pipelining benchmark (torchrun, {cfg.stages} ranks)"
    settings = {"threads": cfg.cpus_per_stage, "use_gpu": cfg.use_gpu, "cases": cases}
    native = torchrun(module, cfg.stages, settings, cfg.cpus_per_stage, what)
    described = {
        "api": "torch.distributed.pipelining: PipelineStage + ScheduleGPipe / Schedule1F1B",
        "launcher": f"torchrun --standalone --nproc-per-node {cfg.stages}",
        **{key: value for key, value in native.items() if key != "cases"},
    }
    figures = {}
    for name, case in native["cases"].items():
        label, unit = cases[name]["label"], cases[name]["unit"]
        for run in case["runs"]:
            progress(f"{label}native {run['schedule']} m={run['microbatches']}", run["step_seconds"], unit)
        for skip in case["skipped"]:
            print(f"{label}native {skip['schedule']} m={skip['microbatches']}: skipped, {skip['reason']}", flush=True)
        figures[name] = {**described, **case}
    return figures


def native_resnet(cfg: BenchPipelineConfig, ours: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One round of ``results["native"]``: torch's GPipe and 1F1B on the stages of ``ours``' plan
    (the layer3 split), the model as given; unless ``--memory-format contiguous``, also, in the
    same torchrun, ``results["native_ours_layouts"]``: each stage in the layout ours computed it in
    at that point, so that the runtime and the memory format can be told apart."""
    cases = {"native": resnet_case(cfg, ours["plan"])}
    if cfg.memory_format != "contiguous":
        cases["native_ours_layouts"] = resnet_case(cfg, ours["plan"], ours["runs"])
    return {name: {**figures, "split": "fixed"} for name, figures in native_runs(cfg, cases).items()}


def layer3_split_rounds(
    cfg: BenchPipelineConfig, model: nn.Module, x: Tensor, y: Tensor
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(ours, the native sides by name: ``native_resnet``) on the layer3 split, ``--resnet-rounds``
    times in turn (ours, then native), each side's runs ``pooled``: the ratio of the two is the
    headline of ours against torch, and on a shared machine a single pass of each lets the drift
    between them fall on one side."""
    ours, native = [], []
    for round_ in range(cfg.resnet_rounds):
        print(f"layer3 split, round {round_ + 1} of {cfg.resnet_rounds}", flush=True)
        ours.append(layout_runs(cfg, model, x, y, cfg.split_points, cfg.sweep))
        native.append(native_resnet(cfg, ours[-1]))

    def one(rounds: list[dict[str, Any]]) -> dict[str, Any]:
        runs = pooled([side["runs"] for side in rounds])
        for run in runs:
            run["samples_per_second"] = cfg.global_batch_size / run["step_seconds"]["median"]
        return {**rounds[0], "runs": runs}

    return one(ours), {name: one([side[name] for side in native]) for name in native[0]}
