"""What the cases of ``raytrain-mp bench pipeline`` share: the seeded model and batch every variant
starts from, the optimizer, a sweep's description and progress lines.

Job: give ours and the native peer (``bench.pipeline_native`` imports ``seeded_setup``,
``seeded_mlp``, ``sgd``, ``stage_modules`` and ``virtual_stages`` from here) the same model,
weights, batch, stage cut and optimizer, so that their figures compare.

Invariants:
- ``seeded_setup`` and ``seeded_mlp`` seed torch before building, so the same arguments give the
  same weights and batch in every process.
- ``even_cut`` and ``stage_modules`` cut by block names (``flatten_model``), so a cut travels as
  JSON and both sides build the same stages from it.
- ``Sweep`` holds plain values: it travels as JSON to the native ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from raytrain_mp.models import build_model
from raytrain_mp.optim import build_optimizer
from raytrain_mp.pipeline import StageModule, flatten_model
from raytrain_mp.pipeline.schedule import SCHEDULES

LR = 0.01  # small enough that random labels never blow the weights up (NaNs would change the timing)
MOMENTUM = 0.9
MLP_FEATURES, MLP_HIDDEN, MLP_CLASSES = 32, 64, 10  # the overhead case's model: compute is negligible
INTERLEAVED_VIRTUAL = 2  # stages per actor of the interleaved layouts


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The (schedule, m) points one model's stages run, and how each is timed; ``label`` prefixes
    its progress lines, which show step times in ``unit``. Plain values: it travels as JSON to the
    native ranks."""

    label: str
    unit: str  # "s" or "ms"
    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    warmup: int
    steps: int
    steps_per_call: int = 1  # of the queued measurement (the run loop's --steps-per-call)


def seeded_setup(
    model_name: str, num_classes: int, image_size: int, batch_size: int, seed: int
) -> tuple[nn.Module, Tensor, Tensor]:
    """The model and random batch (inputs, labels) every variant starts from; the native ranks
    call it with the same arguments, so they get the same weights and batch."""
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes, small_stem=None, image_size=image_size)  # the small stem below 64 px
    x = torch.randn(batch_size, 3, image_size, image_size)
    y = torch.randint(num_classes, (batch_size,))
    return model, x, y


def seeded_mlp(layers: int, batch_size: int, seed: int) -> tuple[nn.Module, Tensor, Tensor]:
    """The overhead case's model, ``layers`` Linear layers with ReLUs between them (one pipeline
    block each, ``flatten_model``), and its random batch; seeded like ``seeded_setup``."""
    torch.manual_seed(seed)
    widths = [MLP_FEATURES] + [MLP_HIDDEN] * (layers - 1) + [MLP_CLASSES]
    modules: list[nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        modules += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    model = nn.Sequential(*modules[:-1])
    x = torch.randn(batch_size, MLP_FEATURES)
    y = torch.randint(MLP_CLASSES, (batch_size,))
    return model, x, y


def virtual_stages(schedule: str) -> int:
    """Model chunks per stage actor: ``INTERLEAVED_VIRTUAL`` for the multi-stage schedules, else 1."""
    return INTERLEAVED_VIRTUAL if SCHEDULES[schedule].multi_stage else 1


def even_cut(model: nn.Module, chunks: int) -> tuple[list[str], list[list[str]]]:
    """(split points, block names per chunk) cutting ``model``'s blocks into ``chunks`` runs whose
    lengths differ by at most one; the earlier runs are the shorter."""
    names = [block.name for block in flatten_model(model)]
    cuts = [len(names) * i // chunks for i in range(1, chunks)]
    return [names[c] for c in cuts], [names[a:b] for a, b in zip([0, *cuts], [*cuts, len(names)])]


def stage_modules(model: nn.Module, stage_blocks: Sequence[Sequence[str]]) -> list[StageModule]:
    """The stages a plan describes (block names per stage), sharing ``model``'s modules."""
    by_name = {block.name: block for block in flatten_model(model)}
    return [StageModule(model, [by_name[name] for name in names]) for names in stage_blocks]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer every variant uses (the pipeline stages build the same one)."""
    return build_optimizer(model.parameters(), "sgd", LR, MOMENTUM, 0.0)


def progress(label: str, step_seconds: dict[str, float], unit: str = "s") -> None:
    """One line per figure as it is measured (a default run takes minutes), in ``unit`` (s, ms)."""
    shown = in_ms(step_seconds) if unit == "ms" else step_seconds
    print(f"{label}: {shown['median']:.3f} {unit}/step (min {shown['min']:.3f}, max {shown['max']:.3f})", flush=True)


def in_ms(step_seconds: dict[str, float]) -> dict[str, float]:
    return {key: value * 1000 for key, value in step_seconds.items()}


def find_run(layout: dict[str, Any], schedule: str, m: int) -> dict[str, Any] | None:
    return next((r for r in layout["runs"] if r["schedule"] == schedule and r["microbatches"] == m), None)
