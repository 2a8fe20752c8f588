"""What ``torch.compile`` alone buys on this machine: one process, one thread, the SGD step of
ResNet-18 (small stem) eager and compiled, in alternating rounds (the machine's load drifts), with
no Ray, DDP or data loading around it.

    python scripts/compile_speedup.py [IMAGE_SIZE] [BATCH]     # default 32 32

Prints each side's median step (min-max) over 3 rounds of 8 steps after 2, the compiled first step
(inductor from an empty cache), and the ratio; ``docs/performance.md`` quotes it beside
``raytrain-mp bench ddp --compile``, whose compiled figures cannot beat what compiling buys here.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from raytrain_mp.models import build_model

ROUNDS, STEPS, WARMUP = 3, 8, 2


def step_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    return seconds


def main(size: int = 32, batch: int = 32) -> None:
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-speedup-")  # a cold first step
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, size, size, generator=generator), torch.randint(0, 10, (batch,), generator=generator)
    models = {}
    for side in ("eager", "compiled"):
        torch.manual_seed(0)
        models[side] = build_model("resnet18", 10, 3, True)
    models["compiled"] = torch.compile(models["compiled"])
    (first,) = step_seconds(models["compiled"], x, y, 1)
    seconds: dict[str, list[float]] = {side: [] for side in models}
    for _ in range(ROUNDS):
        for side, model in models.items():
            seconds[side] += step_seconds(model, x, y, WARMUP + STEPS)[WARMUP:]
    for side, values in seconds.items():
        print(f"{side}: {statistics.median(values):.3f} s a step ({min(values):.3f}-{max(values):.3f})")
    ratio = statistics.median(seconds["eager"]) / statistics.median(seconds["compiled"])
    print(f"compiled first step {first:.1f} s; compiled / eager speed {ratio:.2f}x ({size}x{size}, batch {batch})")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]))
