"""The memory format a model or a pipeline stage computes in: channels-last or contiguous, chosen by
measurement, while every tensor that crosses its edges stays contiguous.

Job: ``in_layout(module, layout)`` stores the module's 4-D weights in ``layout`` (torch's own
``nn.Module.to(memory_format=...)``, in place) and returns what runs it: for ``"channels_last"`` a
``ChannelsLast`` wrapper, which runs it on a channels-last copy of a 4-D input and hands back a
contiguous output; for ``"contiguous"`` the module itself. ``layout_runner`` does the same with
the module compiled, its edges kept outside the graph (``ContiguousEdges`` for contiguous).
``layout_seconds`` times a copy of a module in each layout on one micro-batch, as it will run
(compiled under ``--compile``: the copy's graphs are the module's, so its compile fills the cache
the module then reads); ``faster_layout`` names the faster (``"auto"``). Used by the pipeline's
stages and by the DDP loop alike.

Why: convolutions on NHWC run faster where the kernels are written for it (oneDNN on CPUs, tensor
cores under autocast on GPUs), but not everywhere: on ResNet-50 channels-last speeds the early,
high-resolution layers up and slows the late 8x8 and 4x4 ones down (the figures: docs/pipeline.md,
"Memory format"). So a stage is measured in both, as it will run. Why not torch's runtime alone:
``PipelineStage`` sizes its receive buffers from shapes (contiguous), and a P2P transfer (gloo,
NCCL) moves a tensor's storage as raw bytes, so a channels-last activation or gradient sent as it
is would arrive scrambled into the peer's buffer. This module is that boundary, written once for
the trainers and the benchmark.

Invariants:
- Only the layout changes: values equal those of the contiguous module (up to the summation
  order inside a kernel; float64 stays within 1e-14).
- A module keeps its own parameters, converted in place, so state-dict keys and an optimizer
  built over them are unchanged; tensors that are not 4-D floating point pass untouched.
- What ``in_layout`` returns gives a contiguous output, and the gradient of its input comes back
  contiguous: what a receive buffer expects.
- ``layout_seconds`` and ``faster_layout`` work on a copy: the module's parameters, gradients and BatchNorm statistics
  are left as they were.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from raytrain_mp.config import LAYOUTS

_FORMAT = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}


class _ToLayout(torch.autograd.Function):
    """A copy of ``x`` in ``memory_format`` whose gradient goes back contiguous (``Tensor.contiguous``'s
    own backward would pass it on in that format; a compiled graph's in whatever strides it chose)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, memory_format: torch.memory_format) -> Tensor:
        y = x.contiguous(memory_format=memory_format)
        # Already in that format (always, for a contiguous one; 1x1 maps, one channel): ``contiguous``
        # hands back the input, and autograd forbids the stage's in-place ops (ReLU(inplace=True)) on
        # a Function's input.
        return y.clone() if y is x else y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.contiguous(), None


class ChannelsLast(nn.Module):
    """Runs ``module`` (stored channels-last) on a channels-last 4-D input; the output is contiguous."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module.to(memory_format=torch.channels_last)

    def forward(self, x: Tensor) -> Tensor:
        if _is_image(x):
            x = _ToLayout.apply(x, torch.channels_last)
        return self.module(x).contiguous()


class ContiguousEdges(nn.Module):
    """Runs ``module`` (a compiled one, whose output and input gradient may come in any strides) with
    contiguous tensors at its edges: what a P2P send of either needs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad:
            x = _ToLayout.apply(x, torch.contiguous_format)
        return self.module(x).contiguous()


def in_layout(module: nn.Module, layout: str) -> nn.Module:
    """``module`` stored in ``layout`` (in place), and what runs it with contiguous tensors at its edges."""
    if layout == "channels_last":
        return ChannelsLast(module)
    return module.to(memory_format=_FORMAT[layout])


def layout_runner(module: nn.Module, layout: str, compile: Callable[[nn.Module], Callable] | None = None) -> nn.Module:
    """``in_layout`` of ``module``, compiled where ``compile`` is given: the compiled graph computes
    in ``layout``; the conversions at its edges stay outside it, eager, so that what the runner
    hands back (its output, its input's gradient) is contiguous whatever strides inductor chose
    inside (a compiled ResNet stage's input gradient came back channels-last, which a P2P send
    refuses). A compiled runner's input that needs a gradient is copied once a pass for that."""
    if compile is None:
        return in_layout(module, layout)
    runner = in_layout(compile(module), layout)
    return runner if layout == "channels_last" else ContiguousEdges(runner)


def layout_seconds(
    module: nn.Module,
    sample: Tensor,
    input_grad: bool,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    compile: Callable[[nn.Module], Callable] | None = None,
    layouts: tuple[str, ...] = LAYOUTS,
    repeats: int = 2,
) -> dict[str, float]:
    """The forward+backward seconds of a copy of ``module`` (run through ``wrap``, e.g. under
    autocast, then ``compile`` where given) on ``sample`` (with its gradient when ``input_grad``,
    as every stage but the first computes it) in each of ``layouts``: the median of ``repeats``
    passes after one untimed pass (the one that compiles). Empty when ``sample`` is not a 4-D
    floating point tensor (there is no layout to choose)."""
    if not _is_image(sample):
        return {}
    seconds = {}
    for layout in layouts:
        runner = layout_runner(wrap(copy.deepcopy(module)), layout, compile)
        x = sample.detach().clone().requires_grad_(input_grad)
        passes = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            runner(x).float().square().mean().backward()
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            passes.append(time.perf_counter() - start)
        seconds[layout] = statistics.median(passes[1:])
    return seconds


def faster_layout(
    module: nn.Module,
    sample: Tensor,
    input_grad: bool,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    compile: Callable[[nn.Module], Callable] | None = None,
    repeats: int = 2,
) -> str:
    """The layout in which ``layout_seconds`` finds the least seconds; ``"contiguous"`` when
    ``sample`` is not a 4-D floating point tensor (there is nothing to choose)."""
    seconds = layout_seconds(module, sample, input_grad, wrap, compile, repeats=repeats)
    return min(seconds, key=seconds.__getitem__) if seconds else "contiguous"


def _is_image(x: Tensor) -> bool:
    return x.dim() == 4 and x.is_floating_point()
