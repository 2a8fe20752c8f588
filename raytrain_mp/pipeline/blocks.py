"""Flatten a model into an ordered list of named blocks, and build a stage from a run of blocks.

Job: know model internals, so that partitioning and the Ray stage code never have to: torchvision
ResNets and plain ``nn.Sequential`` here, through ``_FLATTENERS``; any other model from its traced
graph (``traced``). ``flatten_model`` chooses among them. What a block is, and what passes between
blocks, is ``block``'s.

A block is a place a stage boundary can fall before. A ResNet's residual blocks are cut at each
convolution, so that time balance is not limited to whole residual blocks (ResNet-50's are 4-7%
of its time each): ``layer3.0.conv1`` (conv1, bn1, ReLU), ``layer3.0.conv2``, ``layer3.0.conv3``
(the last conv, the residual sum and its ReLU); a split point ``"layer3.0"`` or ``"layer3"``
cuts before the first. Other kinds of residual block run whole. The downsample rides with the
strided convolution, so the pieces of a block pass on (main path, identity) at the same spatial
size. Within a stage that pair stays a tuple; a stage whose last block leaves one sends it
packed along the channels (``block.pack``), and the next block splits it by its convolution's
input channels.

A ``StageModule`` registers each module its blocks name under the same path, so:

Invariants:
- Running the blocks of ``flatten_model(model)`` in order on ``model`` equals ``model(x)``
  exactly: the pieces of a residual block run its own modules in its own order.
- Every parameter and buffer of the model lies under exactly one block's paths (checked), so the
  state dicts of stages built from disjoint runs of blocks are disjoint, carry the original keys
  (``"layer3.0.conv1.weight"``), and their union loads into the model with ``strict=True``.
- Blocks refer to modules by path, so replacing a module inside a stage (e.g. converting its
  BatchNorms) keeps the stage runnable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torchvision.models import ResNet
from torchvision.models.resnet import BasicBlock, Bottleneck

from raytrain_mp.errors import OptionError
from raytrain_mp.pipeline.block import Block, Carry, pack, resolve
from raytrain_mp.pipeline.traced import flatten_traced


@dataclass(frozen=True)
class ResidualPiece:
    """Runner of one piece of a torchvision residual block. Its modules are a convolution, its
    BatchNorm, the block's ReLU and, with the strided convolution, the block's downsample."""

    first: bool  # takes the block's input
    last: bool  # adds the identity, and returns the block's output

    def __call__(self, modules: Sequence[nn.Module], carry: Carry) -> Carry:
        conv, bn, relu, *downsample = modules
        if self.first:
            h, identity = carry, carry
        elif isinstance(carry, tuple):
            h, identity = carry
        else:  # packed by the previous stage; one split, whose backward is one cat of the two gradients
            h, identity = carry.split([conv.in_channels, carry.shape[1] - conv.in_channels], 1)
        h = bn(conv(h))
        if downsample:
            identity = downsample[0](identity)
        return relu(h + identity) if self.last else (relu(h), identity)


def _resnet_head(modules: Sequence[nn.Module], x: Tensor) -> Tensor:
    # torchvision's ResNet.forward flattens between avgpool and fc with a function, not a module.
    avgpool, fc = modules
    return fc(torch.flatten(avgpool(x), 1))


def _residual_pieces(path: str, block: nn.Module) -> list[Block]:
    convs = 3 if isinstance(block, Bottleneck) else 2
    strided = 2 if convs == 3 else 1  # torchvision's Bottleneck strides its 3x3 conv (ResNet v1.5)
    pieces = []
    for k in range(1, convs + 1):
        paths = (f"{path}.conv{k}", f"{path}.bn{k}", f"{path}.relu")
        if k == strided and block.downsample is not None:
            paths += (f"{path}.downsample",)
        pieces.append(Block(f"{path}.conv{k}", paths, ResidualPiece(k == 1, k == convs)))
    return pieces


def _flatten_resnet(model: ResNet) -> list[Block]:
    blocks = [Block("stem", ("conv1", "bn1", "relu", "maxpool"))]
    for layer in ("layer1", "layer2", "layer3", "layer4"):
        for i, block in enumerate(getattr(model, layer)):
            path = f"{layer}.{i}"
            # A block of another kind runs whole: only torchvision's own are known piece by piece.
            known = isinstance(block, (BasicBlock, Bottleneck))
            blocks += _residual_pieces(path, block) if known else [Block(path, (path,))]
    blocks.append(Block("head", ("avgpool", "fc"), _resnet_head))
    return blocks


def _flatten_sequential(model: nn.Sequential) -> list[Block]:
    # A child without parameters (an activation, a pooling) joins the block before it, so that
    # every block, and so every stage, has parameters for its optimizer. Named "0+1" for children 0, 1.
    groups: list[tuple[list[str], bool]] = []  # (child names, whether any has parameters)
    for name, child in model.named_children():
        has_params = next(child.parameters(), None) is not None
        if groups and not (has_params and groups[-1][1]):
            groups[-1] = (groups[-1][0] + [name], groups[-1][1] or has_params)
        else:
            groups.append(([name], has_params))
    return [Block("+".join(names), tuple(names)) for names, _ in groups]


# Checked in order with isinstance; the only place that knows how a model type runs.
_FLATTENERS: dict[type, Callable[[nn.Module], list[Block]]] = {
    ResNet: _flatten_resnet,
    nn.Sequential: _flatten_sequential,
}


def flatten_model(model: nn.Module, sample: Tensor | None = None) -> list[Block]:
    """The model's blocks in forward order (ResNet: stem, each residual block, head). A model no
    flattener knows is cut from its traced graph, which needs ``sample``, a batch of inputs."""
    flatten = next((f for model_type, f in _FLATTENERS.items() if isinstance(model, model_type)), None)
    blocks = flatten(model) if flatten is not None else flatten_traced(model, sample)
    _check_covers_state(model, blocks)
    return blocks


def _check_covers_state(model: nn.Module, blocks: Sequence[Block]) -> None:
    paths = {path for block in blocks for path in block.paths}
    prefixes = tuple(f"{path}." for path in paths)
    outside = [key for key in model.state_dict() if key not in paths and not key.startswith(prefixes)]
    if outside:
        raise OptionError("model", f"state outside every pipeline block: {', '.join(outside[:5])}")


def block_parameter_counts(model: nn.Module, blocks: Sequence[Block]) -> list[int]:
    """Number of parameter elements each block owns."""
    return [sum(_parameter_count(resolve(model, path)) for path in block.paths) for block in blocks]


def _parameter_count(target: nn.Module | Tensor) -> int:
    if isinstance(target, nn.Module):
        return sum(p.numel() for p in target.parameters())
    return target.numel() if isinstance(target, nn.Parameter) else 0


class StageModule(nn.Module):
    """A contiguous run of blocks whose modules sit under their original paths.

    Intermediate containers (``layer3`` for ``layer3.0``) are empty ``nn.Module``s: they add no
    state, so the state-dict keys are exactly the original model's keys for these blocks.
    """

    def __init__(self, model: nn.Module, blocks: Sequence[Block]) -> None:
        super().__init__()
        self.blocks = tuple(blocks)
        for block in self.blocks:
            for path in block.paths:
                self._attach(model, path)

    def _attach(self, model: nn.Module, path: str) -> None:
        """Put what ``model`` has at ``path`` at the same path here: a module, or (traced blocks)
        a parameter or buffer, which keeps its persistence."""
        *parents, leaf = path.split(".")
        owner: nn.Module = self
        source = model
        for name in parents:
            source = getattr(source, name)
            if owner._modules.get(name) is source:
                return  # the whole module is here already, and what it holds with it
            if name not in owner._modules:
                owner.add_module(name, nn.Module())
            owner = owner._modules[name]
        target = getattr(source, leaf)
        if isinstance(target, nn.Module):
            owner.add_module(leaf, target)
        elif isinstance(target, nn.Parameter):
            owner.register_parameter(leaf, target)
        else:  # a buffer, or a constant the tracer stored on the model
            owner.register_buffer(
                leaf, target, persistent=leaf in source._buffers and leaf not in source._non_persistent_buffers_set
            )

    def forward(self, x: Tensor) -> Tensor:
        carry: Carry = x
        for block in self.blocks:
            carry = block.forward_on(self, carry)
        return pack(carry)
