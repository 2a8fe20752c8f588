"""Cut any model that torch.fx can trace into pipeline blocks, at its module boundaries.

Job: the flattener of ``blocks.flatten_model`` for every model that is neither a torchvision
ResNet nor an ``nn.Sequential`` (MobileNet, EfficientNet, ConvNeXt, RegNet, ViT, a user's own
network). It traces the model once, finds the places where a stage boundary can fall, and turns
each run of graph nodes between two such places into a ``block.Block`` whose runner
(``GraphSegment``) executes those nodes on the modules found under the block's paths.

Why ``torch.fx.symbolic_trace`` and not ``torch.export`` (on which torch's own pipelining
frontend, ``torch.distributed.pipelining.pipeline``, is built): fx keeps the model's modules. A
``call_module`` node runs the very ``nn.Module`` at its path, so BatchNorm updates its running
statistics in place as it does in the model, deferred BatchNorm replaces a stage's BatchNorms by
path and the block still runs, every parameter and buffer keeps its key, and the merged state
dict loads with ``strict=True`` into the user's model. ``torch.export`` lowers modules to aten ops
and turns buffer updates into graph outputs, so there would be no BatchNorm module to defer, and
its graph is fixed to one mode (train or eval). Leaf modules here are torch.nn's and any module
without children (torchvision's ``StochasticDepth``, ``LayerNorm2d``, a user's small layer): they
run as calls, so whatever they decide on ``self.training`` stays live in train and eval.

A model fx cannot trace as a whole is traced again with the failing submodule as a leaf (it
then runs whole, inside one stage), until the trace succeeds; only a forward whose own top
level cannot be traced is refused, with the construct fx named and what helps.

Where a cut may fall (``cut_positions``): before a node that starts a module (a
``call_module`` node, or the first node traced inside a module's forward), if every value that
crosses it is a floating-point tensor computed from the input whose first dimension is the
batch (checked on probe batches of 2 and 3 samples), and no parameter or buffer is used on both
sides. Several values may cross (a skip connection over the cut): a stage sends them as one
tensor, each flattened per sample and joined (``block.Live``, ``block.pack``), and the
receiving block splits them back to the shapes the probe recorded. A block is named by the
innermost module its first node starts (``features.7.block.0.0``), so that a split point names
a module by prefix as for ResNets (``features.7``, ``encoder.layers.encoder_layer_3``).

Invariants:
- Running the blocks in order equals ``model(x)`` exactly: the same nodes, in the graph's order,
  on the same modules.
- Every parameter and buffer the forward uses lies under exactly one block's paths (a cut never
  separates two uses of the same state).
- Blocks hold names and picklable op records, never modules or tensors of the model.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.fx.node import map_aggregate

from raytrain_mp.errors import OptionError
from raytrain_mp.pipeline.block import Block, Carry, Live

PROBE_BATCHES = (2, 3)  # two batch sizes, so that a dimension that follows the batch is told apart from a constant


@dataclass(frozen=True)
class Ref:
    """A value computed by an earlier node, by the node's name."""

    name: str


@dataclass(frozen=True)
class Op:
    """One graph node: ``kind`` is fx's op (``call_module``, ``get_attr``, ``call_function``,
    ``call_method``); ``target`` the function, the method's name, or an index into the block's paths."""

    name: str
    kind: str
    target: Any
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class GraphSegment:
    """Runner of a block of graph nodes: takes the values live before it (one tensor, a tuple of
    them, or the tuple packed into one tensor by the previous stage), returns those live after."""

    inputs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # per sample, of each input: to split a packed tensor
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]

    def __call__(self, targets: Sequence[Any], carry: Carry) -> Carry:
        env = dict(zip(self.inputs, self._received(carry)))

        def value(arg: Any) -> Any:
            return env[arg.name] if isinstance(arg, Ref) else arg

        for op in self.ops:
            args, kwargs = map_aggregate(op.args, value), map_aggregate(op.kwargs, value)
            if op.kind == "call_module":
                env[op.name] = targets[op.target](*args, **kwargs)
            elif op.kind == "get_attr":
                env[op.name] = targets[op.target]
            elif op.kind == "call_method":
                env[op.name] = getattr(args[0], op.target)(*args[1:], **kwargs)
            else:
                env[op.name] = op.target(*args, **kwargs)
        outputs = tuple(env[name] for name in self.outputs)
        return outputs[0] if len(outputs) == 1 else Live(outputs)

    def _received(self, carry: Carry) -> tuple[Tensor, ...]:
        # The model may modify a value in place (ReLU(inplace=True)). Autograd forbids that on
        # a stage's input, a leaf that needs a gradient, and on the views a split returns: those
        # are copied, once per stage, never the values blocks of one stage pass each other.
        if isinstance(carry, tuple):
            return tuple(_writable(value) for value in carry)
        if len(self.inputs) == 1:
            return (_writable(carry),)
        # Packed by the previous stage (``block.pack``); the backward of the split joins the gradients.
        parts = carry.split([_numel(shape) for shape in self.shapes], 1)
        values = (part.reshape(len(carry), *shape) for part, shape in zip(parts, self.shapes))
        return tuple(value.clone() if value._is_view() else value for value in values)


def _writable(value: Tensor) -> Tensor:
    return value.clone() if value.is_leaf and value.requires_grad else value


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class _Tracer(fx.Tracer):
    """fx's tracer, with modules without children and the ``extra`` paths as leaves."""

    def __init__(self, extra: frozenset[str]) -> None:
        super().__init__()
        self.extra = extra

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.extra or next(m.children(), None) is None or super().is_leaf_module(m, qualname)


def trace(model: nn.Module) -> fx.Graph:
    """The model's graph in train mode; a submodule fx cannot trace becomes a leaf."""
    leaves: frozenset[str] = frozenset()
    was_training = {m: m.training for m in model.modules()}
    model.train()
    try:
        while True:
            tracer = _Tracer(leaves)
            try:
                return tracer.trace(model)
            except Exception as exc:  # fx raises TraceError, TypeError, AttributeError, ... for untraceable code
                # fx pops a module from its stack only when the module's trace returns: what is
                # left names the innermost module whose forward failed.
                failing = next(reversed(tracer.module_stack.values()), ("", None))[0]
                if not failing or failing in leaves:
                    raise OptionError("model", _untraceable(model, exc)) from None
                leaves |= {failing}
    finally:
        for module, mode in was_training.items():
            module.train(mode)


def _untraceable(model: nn.Module, exc: Exception) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"the pipeline cannot trace {type(model).__name__}.forward with torch.fx ({reason}{where}); "
        "its own forward must be traceable (move the untraceable part into a submodule, which then runs "
        "whole in one stage), or give an nn.Sequential"
    )


@dataclass(frozen=True)
class _Seen:
    """What a node produced on the probe batches."""

    batched: bool  # a floating-point tensor from the input whose first dimension is the batch
    shape: tuple[int, ...]  # per sample, when batched


def _probe(model: nn.Module, graph: fx.Graph, sample: Tensor) -> dict[str, _Seen]:
    """Run the graph on probe batches cut from ``sample``, in eval mode without autograd (no
    statistics change), and record which values are per-sample tensors."""
    runs: list[dict[str, Any]] = []
    module = fx.GraphModule(model, graph)  # shares the model's modules; nothing is copied
    was_training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            for batch in PROBE_BATCHES:
                x = sample[:1].expand(batch, *sample.shape[1:]).clone()
                values: dict[str, Any] = {}
                interpreter = fx.Interpreter(module)
                run_node = interpreter.run_node

                def record(node: fx.Node, run_node=run_node, values=values) -> Any:
                    values[node.name] = result = run_node(node)
                    return result

                interpreter.run_node = record  # type: ignore[method-assign]
                interpreter.run(x)
                runs.append(values)
    finally:
        for m, mode in was_training.items():
            m.train(mode)
    seen = {}
    for name in runs[0]:
        first, second = (run[name] for run in runs)
        batched = (
            all(
                isinstance(v, Tensor) and v.is_floating_point() and v.dim() >= 1 and v.shape[0] == b
                for v, b in ((first, PROBE_BATCHES[0]), (second, PROBE_BATCHES[1]))
            )
            and first.shape[1:] == second.shape[1:]
        )
        seen[name] = _Seen(batched, tuple(first.shape[1:]) if batched else ())
    return seen


def _scopes(node: fx.Node) -> list[tuple[str, str]]:
    """(key, module path) of every module the node lies in, outermost first; a module called
    again gets a new key (``relu@1``), so consecutive calls are told apart."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(key, value[0]) for key, value in stack.items()]


def flatten_traced(model: nn.Module, sample: Tensor | None) -> list[Block]:
    """The model's blocks, cut at every module boundary where a cut can fall (module docstring)."""
    kind = type(model).__name__
    if sample is None:
        raise OptionError(
            "model",
            f"cutting a {kind} from its traced graph needs an example input "
            "(PipelineTrainer's sample_input, a batch like the training batches)",
        )
    graph = trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise OptionError("model", f"{kind}.forward takes {len(placeholders)} inputs; the pipeline feeds it one tensor")
    (output,) = [n for n in graph.nodes if n.op == "output"]
    if not isinstance(output.args[0], fx.Node):  # the loss takes one tensor of logits
        raise OptionError(
            "model",
            f"{kind}.forward returns a {type(output.args[0]).__name__}; the pipeline's last stage needs one "
            "tensor of logits",
        )
    seen = _probe(model, graph, sample)
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    cuts = cut_positions(model, placeholders[0], body, output, seen)
    bounds = [0, *cuts, len(body)]
    blocks, names = [], set()
    for start, stop in zip(bounds, bounds[1:]):
        name = _block_name(body, start, stop, names)
        names.add(name)
        blocks.append(_block(name, body[start:stop], placeholders[0], body, start, stop, output, seen))
    return blocks


def cut_positions(
    model: nn.Module, source: fx.Node, body: Sequence[fx.Node], output: fx.Node, seen: dict[str, _Seen]
) -> list[int]:
    """Indices ``i`` into ``body`` before which a cut can fall (module docstring)."""
    index = {node: i for i, node in enumerate(body)}
    index[source] = -1
    last_use = {node: max((index.get(user, len(body)) for user in node.users), default=index[node]) for node in index}
    from_input = {source}
    for node in body:
        if any(arg in from_input for arg in node.all_input_nodes):
            from_input.add(node)
    spans = _state_spans(model, body)
    cuts = []
    for i in range(1, len(body)):
        before, here = {key for key, _ in _scopes(body[i - 1])}, _scopes(body[i])
        if not any(key not in before for key, _ in here):
            continue  # starts no module
        crossing = [node for node in index if index[node] < i <= last_use[node]]
        if all(node in from_input and seen[node.name].batched for node in crossing) and not any(
            first < i <= last for first, last in spans
        ):
            cuts.append(i)
    return cuts


def _state_spans(model: nn.Module, body: Sequence[fx.Node]) -> list[tuple[int, int]]:
    """(first, last) index of the nodes using each parameter or buffer, by state key."""
    keys = list(model.state_dict(keep_vars=True))
    uses: dict[str, list[int]] = {}
    for i, node in enumerate(body):
        if node.op in ("call_module", "get_attr"):
            for key in keys:
                if key == node.target or key.startswith(f"{node.target}."):
                    uses.setdefault(key, []).append(i)
    return [(min(at), max(at)) for at in uses.values()]


def _block_name(body: Sequence[fx.Node], start: int, stop: int, taken: set[str]) -> str:
    before = {key for key, _ in _scopes(body[start - 1])} if start else set()
    started = [path for key, path in _scopes(body[start]) if key not in before]
    modules = [node.target for node in body[start:stop] if node.op == "call_module"]
    name = (started or modules or ["input"])[-1 if started else 0]
    unique, count = name, 1
    while unique in taken:
        count += 1
        unique = f"{name}@{count}"
    return unique


def _block(
    name: str,
    nodes: Sequence[fx.Node],
    source: fx.Node,
    body: Sequence[fx.Node],
    start: int,
    stop: int,
    output: fx.Node,
    seen: dict[str, _Seen],
) -> Block:
    # What crosses a cut is every value used after it, also by a later block only (a skip).
    defined_before = [source, *body[:start]]
    from_here, later = set(body[start:]) | {output}, set(body[stop:]) | {output}
    inputs = [n for n in defined_before if any(user in from_here for user in n.users)]
    outputs = [n for n in [*defined_before, *nodes] if any(user in later for user in n.users)]
    paths: list[str] = []
    for node in nodes:
        if node.op in ("call_module", "get_attr") and node.target not in paths:
            paths.append(node.target)
    ops = tuple(_op(node, paths) for node in nodes)
    segment = GraphSegment(
        inputs=tuple(n.name for n in inputs),
        shapes=tuple(seen[n.name].shape for n in inputs) if len(inputs) > 1 else ((),),
        ops=ops,
        outputs=tuple(n.name for n in outputs),
    )
    return Block(name, tuple(paths), segment)


def _op(node: fx.Node, paths: list[str]) -> Op:
    def ref(arg: Any) -> Any:
        return Ref(arg.name) if isinstance(arg, fx.Node) else arg

    args, kwargs = map_aggregate(node.args, ref), map_aggregate(dict(node.kwargs), ref)
    target = paths.index(node.target) if node.op in ("call_module", "get_attr") else node.target
    return Op(node.name, node.op, target, tuple(args), dict(kwargs))
