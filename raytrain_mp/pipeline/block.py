"""A block, the unit a model is cut into for the pipeline, and the values that pass between blocks.

Job: say what a block is (``Block``: a name, the dotted paths of what it runs, and its runner) and
what one block hands the next (``Carry``), so that the flatteners (``blocks`` for ResNets and
``nn.Sequential``, ``traced`` for any model torch.fx traces), partitioning and the stages share
one definition. It knows no model type.

Invariants:
- A block names the modules (or, traced, the parameters and buffers) it runs by their original
  dotted paths (``"layer3.0.conv1"``) and never holds them: it runs on whatever is found at those
  paths under the root it is given (``Block.forward_on``), so a stage that registers them under
  the same paths runs it. Blocks and their runners pickle without the model.
- One tensor crosses every stage boundary (``pack``): a residual block's (main path, identity)
  pair joined along the channels, or a traced block's ``Live`` values flattened per sample and
  joined; the receiving block splits it back. So the P2P protocol and torch's stage metadata see a
  single activation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

Carry = Tensor | tuple[Tensor, ...]  # between blocks: a residual block's (main path, identity), or ``Live``
Runner = Callable[[Sequence[nn.Module], Carry], Carry]


class Live(tuple):
    """The values a traced block passes on (``traced``): tensors of any shapes whose first
    dimension is the batch. Packed, each is flattened per sample and the rows joined."""


def run_in_order(modules: Sequence[nn.Module], x: Carry) -> Carry:
    """The common case: a block is its modules applied one after another."""
    for module in modules:
        x = module(x)
    return x


def pack(carry: Carry) -> Tensor:
    """The one tensor a stage sends: a (main path, identity) pair joined along the channels, or
    a traced block's ``Live`` values flattened per sample and joined (``traced`` splits them)."""
    if isinstance(carry, Live):
        return torch.cat([t.reshape(len(t), -1) for t in carry], 1)
    return torch.cat(carry, 1) if isinstance(carry, tuple) else carry


def resolve(root: nn.Module, path: str) -> nn.Module | Tensor:
    """The module, parameter or buffer at ``path`` under ``root``."""
    target: Any = root
    for name in path.split("."):
        target = getattr(target, name)
    return target


@dataclass(frozen=True)
class Block:
    """One unit of the flattened model: the modules (or, traced, parameters and buffers) at
    ``paths``, run by ``run``."""

    name: str
    paths: tuple[str, ...]
    run: Runner = run_in_order

    def forward_on(self, root: nn.Module, x: Carry) -> Carry:
        """Run this block with the modules found at its paths under ``root``."""
        return self.run([resolve(root, path) for path in self.paths], x)
