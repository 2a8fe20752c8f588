"""Build the model a trainer trains, adapted to the data set; never anything Ray-aware.

``--model`` takes one of two kinds of name:

- a torchvision classifier, any of ``torchvision.models.list_models(module=torchvision.models)``
  (``resnet18``, ``mobilenet_v3_small``, ``vit_b_16``, ...), built with ``weights=None`` and the data
  set's ``num_classes``: weights are random (seeded by the caller) or read from ``--weights``, a
  state dict file, fitted by ``pretrained.fit_state`` (a new head for another class count, an
  adapted stem for another channel count; torchvision weights names are fetched into torchvision's
  cache and resolved to that file by ``pretrained.resolve``, on the driver);
- ``package.module:callable``, the user's own network: the module is imported with the current
  working directory on ``sys.path`` (as ``python -m`` has it; the ``raytrain-mp`` console script
  does not), and the callable is called as ``callable(num_classes=K, in_channels=C, image_size=S)``
  and must return an ``nn.Module``. Ray workers find the module because Ray puts the driver's
  working directory on their ``sys.path`` (or ships it, under ``ray job submit --working-dir .``).

How a torchvision model is adapted to data of C channels, S x S pixels and K classes, the one place
these rules live (a user's callable gets C, S and K and owns its architecture: it is never edited):

==========================  ===========================================================================
what                        rule
==========================  ===========================================================================
classes                     ``num_classes=K``, ``weights=None``
C != 3 channels             the first ``nn.Conv2d`` with 3 input channels (the stem in every torchvision
                            family) is replaced, at the same module path, by a Conv2d with the same
                            hyper-parameters and C inputs: state-dict keys stay torchvision's
small images, ResNets       below 64 px (``wants_small_stem``, or ``--small-stem``) the stem becomes a 3x3
                            stride-1 conv and the max-pool goes (the CIFAR stem)
small images, others        built as torchvision has them; ``--small-stem`` is an error (no such rule)
image size as an argument   ViT gets ``image_size=S``, MaxViT ``input_size=(S, S)`` (their position
                            tables and window grids are sized from it)
ViT patch size              S must be a multiple of the patch size, else one error line naming it
GoogLeNet, Inception v3     ``aux_logits=False`` (training would return named tuples, not logits),
                            ``init_weights=True`` (torchvision warns without it)
too small for the model     a probe forward (eval mode, no_grad, a batch of 2 of C x S x S) before any
                            worker starts; failing, one error line naming the smallest of
                            ``PROBE_SIZES`` that works
==========================  ===========================================================================

Invariants:
- The state dict of a built model is the one a user gets from ``build_model`` with the same
  arguments, so a checkpoint's ``model.pt`` loads into it with ``strict=True``.
- ``check_model`` raises a one-line ``UsageError`` starting ``--model:`` for every name, module,
  callable or size that cannot train, and leaves torch's global random state as it found it (the
  drivers build their own models after it, seeded).
- torch and torchvision are imported when a model is built or checked, not with the module: the
  command line builds its parser and validates option syntax from here, and ``--help`` must not
  wait for torch.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_mp.errors import UsageError
from raytrain_mp.model_names import check_torchvision_name, unknown_model

if TYPE_CHECKING:
    from torch import nn

MODEL_HELP = (
    "any torchvision.models classifier (torchvision.models.list_models()), e.g. resnet18, mobilenet_v3_small, "
    "vit_b_16; or package.module:callable, called with num_classes, in_channels, image_size and returning an "
    "nn.Module (the working directory is importable)"
)
# The ResNet family (torchvision.models.ResNet), the models the small-stem rule and the pipeline
# benchmark's layer3 split apply to; tests/test_models.py checks it against torchvision.
RESNET_NAMES = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "resnext101_32x8d",
    "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2",
)  # fmt: skip
# Sizes tried, smallest first, to name the smallest one a model takes: a short list keeps the
# failing check cheap (each is one forward of 2 samples, one build where the size is an argument).
PROBE_SIZES = (16, 24, 32, 48, 64, 96, 128, 160, 224, 299)
# Builder arguments by torchvision module: the image size where the model is sized from it, and
# switches that make the model return plain logits quietly.
_SIZE_ARGUMENT: dict[str, Callable[[int], dict[str, Any]]] = {
    "torchvision.models.vision_transformer": lambda s: {"image_size": s},
    "torchvision.models.maxvit": lambda s: {"input_size": (s, s)},
}
_FIXED_ARGUMENTS: dict[str, dict[str, Any]] = {
    "torchvision.models.googlenet": {"aux_logits": False, "init_weights": True},
    "torchvision.models.inception": {"aux_logits": False, "init_weights": True},
}
_NAME = r"[A-Za-z_]\w*"
_CALLABLE_SPEC = re.compile(rf"{_NAME}(\.{_NAME})*:{_NAME}(\.{_NAME})*")


class SizeRefused(UsageError):
    """A builder that takes the image size refused it; ``check_model`` turns it into the line
    naming the smallest size that works."""


def is_callable_spec(name: str) -> bool:
    """``package.module:callable`` (the user's network) rather than a torchvision name."""
    return ":" in name


def check_model_syntax(name: str) -> None:
    """The name's form, and a torchvision name's existence (``model_names``), without importing
    torch: for ``validate()``, which runs at parse time."""
    if is_callable_spec(name):
        if not _CALLABLE_SPEC.fullmatch(name):
            raise UsageError(f"--model: {name!r} is not of the form package.module:callable (e.g. mymodels:tiny_net)")
    elif not re.fullmatch(_NAME, name):
        raise UsageError(
            f"--model: {name!r} is neither a torchvision model name (e.g. resnet18) nor package.module:callable"
        )
    else:
        check_torchvision_name(name)


def wants_small_stem(image_size: int) -> bool:
    """The 7x7/2 conv and the max-pool shrink a 32x32 image to 8x8 before layer1; below 64 px
    that throws most of the image away, so small images get the CIFAR-style stem."""
    return image_size < 64


def build_model(
    name: str,
    num_classes: int,
    in_channels: int = 3,
    small_stem: bool | None = False,
    weights: str | Path | None = None,
    *,
    image_size: int | None = None,
    say: Callable[[str], None] | None = None,
) -> nn.Module:
    """The model ``name`` (see the module docstring) for ``num_classes`` classes of
    ``in_channels`` x ``image_size`` x ``image_size`` images; ``small_stem`` None decides by
    ``image_size`` (ResNets only); ``weights`` a state dict file loaded into it (``load_weights``,
    whose head and stem lines go to ``say``). Raises ``UsageError`` for a name, module or callable
    that gives no model; sizes are ``check_model``'s job."""
    if num_classes < 2:
        raise UsageError(f"num_classes must be >= 2, got {num_classes}")
    if is_callable_spec(name):
        if small_stem:
            raise UsageError(f"--small-stem: applies to torchvision ResNets; {name} builds its own stem")
        model = _user_model(name, num_classes, in_channels, image_size)
    else:
        model = _torchvision_model(name, num_classes, in_channels, image_size, small_stem)
    if weights is not None:
        load_weights(model, weights, say)
    return model


def _torchvision_model(
    name: str, num_classes: int, in_channels: int, image_size: int | None, small_stem: bool | None
) -> nn.Module:
    from torch import nn
    from torchvision import models as tv_models

    builder = _torchvision_builder(name)
    kwargs: dict[str, Any] = {
        "weights": None,
        "num_classes": num_classes,
        **_FIXED_ARGUMENTS.get(builder.__module__, {}),
    }
    if image_size is not None and builder.__module__ in _SIZE_ARGUMENT:
        kwargs |= _SIZE_ARGUMENT[builder.__module__](image_size)
    try:
        model = builder(**kwargs)
    except (AssertionError, ValueError) as exc:  # a model sized from the image refuses the size
        if builder.__module__ not in _SIZE_ARGUMENT:
            raise
        if builder.__module__ == "torchvision.models.vision_transformer":  # it asserts patch | size
            raise UsageError(_patch_message(name, image_size)) from exc
        raise SizeRefused(f"{type(exc).__name__}: {_first_line(exc)}"[:200]) from exc
    is_resnet = isinstance(model, tv_models.ResNet)
    if small_stem and not is_resnet:
        raise UsageError(
            f"--small-stem: applies to torchvision ResNets ({', '.join(RESNET_NAMES)}); {name} has no such rule"
        )
    if is_resnet and (
        wants_small_stem(image_size) if small_stem is None and image_size is not None else bool(small_stem)
    ):
        model.conv1 = nn.Conv2d(in_channels, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        _set_input_channels(model, in_channels)
    return model


def _torchvision_builder(name: str) -> Callable[..., nn.Module]:
    from torchvision import models as tv_models

    if name not in tv_models.list_models(module=tv_models):  # torchvision is loaded here: its own list
        raise unknown_model(name)
    return tv_models.get_model_builder(name)


def _set_input_channels(model: nn.Module, in_channels: int) -> None:
    """Replace the first 3-input Conv2d (the stem in every torchvision family) by one taking
    ``in_channels``, set at the same module path, so the state dict keeps torchvision's keys."""
    from torch import nn

    path, conv = next((p, m) for p, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.in_channels == 3)
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        conv.bias is not None,
        conv.padding_mode,
    )
    parent_path, _, attribute = path.rpartition(".")
    setattr(model.get_submodule(parent_path), attribute, new)


def _patch_message(name: str, image_size: int | None) -> str:
    patch = _vit_patch_size(name)
    above = -(-(image_size or 1) // patch) * patch
    return (
        f"--model: {name} cuts images into {patch}x{patch} patches, so the image size must be a multiple of "
        f"{patch}; the data's {image_size} px is not: prepare the data with --image-size {above} (the smallest "
        f"size that works is {patch})"
    )


def _vit_patch_size(name: str) -> int:
    """The patch size of torchvision ViT ``name``, read from a model at torchvision's default size
    (224, which every torchvision patch size divides): only on the error path."""
    return _torchvision_builder(name)(weights=None).patch_size


def _user_model(spec: str, num_classes: int, in_channels: int, image_size: int | None) -> nn.Module:
    from torch import nn

    factory = _import_callable(spec)
    kwargs = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
    call = f"{spec}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    try:
        model = factory(**kwargs)
    except Exception as exc:  # the user's code: any failure is reported as one line
        raise UsageError(f"--model: {call} raised {type(exc).__name__}: {_first_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"--model: {call} returned {type(model).__module__}.{type(model).__qualname__}, not a torch.nn.Module"
        )
    return model


def _import_callable(spec: str) -> Callable[..., Any]:
    """The callable named by ``package.module:callable``, the working directory importable first
    (``python -m`` has it on ``sys.path``; a console script and ``python jobs/x.py`` do not)."""
    check_model_syntax(spec)
    module_name, _, attribute = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own code failing on import
        raise UsageError(
            f"--model: module {module_name!r} does not import ({type(exc).__name__}: {_first_line(exc)})"
        ) from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--model: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        kind = type(target).__name__
        raise UsageError(f"--model: {spec} is not callable ({'an' if kind[0] in 'aeiou' else 'a'} {kind})")
    return target


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def check_model(
    name: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    small_stem: bool | None = None,
    weights: str | Path | None = None,
    say: Callable[[str], None] | None = None,
) -> None:
    """Build ``name`` for the data and run one probe forward; raise a one-line ``UsageError``
    (``--model: ...``, or ``--small-stem``/``--weights``) if it cannot train on it. Meant for the
    driver, before any Ray worker starts (``say`` gets the weights' head and stem lines); torch's
    global random state is left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        try:
            model = build_model(name, num_classes, in_channels, small_stem, weights, image_size=image_size, say=say)
            failure = _probe(model, in_channels, image_size)
        except SizeRefused as exc:
            model, failure = None, str(exc)
        if failure is None:
            return
        works = _smallest_size(name, num_classes, in_channels, small_stem, model)
    shape = f"{in_channels}x{image_size}x{image_size}"
    if works is None:
        raise UsageError(
            f"--model: {name} fails on a batch of 2 of {shape} (and on every size of "
            f"{', '.join(map(str, PROBE_SIZES))} px): {failure}"
        )
    raise UsageError(
        f"--model: {name} cannot take {image_size}x{image_size} images ({failure}); the smallest size that works "
        f"(of {', '.join(map(str, PROBE_SIZES))} px tried) is {works}: prepare the data with --image-size {works}"
    )


def _probe(model: nn.Module, in_channels: int, image_size: int) -> str | None:
    """None if ``model`` takes a batch of 2 of ``in_channels`` x ``image_size`` x ``image_size``
    in its own dtype (eval mode: BatchNorm keeps its statistics), else what failed."""
    import torch

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(2, in_channels, image_size, image_size, dtype=dtype))
    except Exception as exc:  # a size that does not fit raises RuntimeError, ValueError or AssertionError
        return f"{type(exc).__name__}: {_first_line(exc)}"[:200]
    finally:
        model.train(was_training)
    return None


def _smallest_size(
    name: str, num_classes: int, in_channels: int, small_stem: bool | None, model: nn.Module | None
) -> int | None:
    """The smallest of ``PROBE_SIZES`` a model of ``name`` takes; the model is rebuilt for each
    size where the size is a build argument (a user's callable, ViT, MaxViT), else reused."""
    from torchvision import models as tv_models

    sized = model is None or is_callable_spec(name) or tv_models.get_model_builder(name).__module__ in _SIZE_ARGUMENT
    for size in PROBE_SIZES:
        try:
            candidate = build_model(name, num_classes, in_channels, small_stem, image_size=size) if sized else model
        except UsageError:  # e.g. a ViT patch size that does not divide this size
            continue
        if _probe(candidate, in_channels, size) is None:
            return size
    return None


def load_weights(model: nn.Module, path: str | Path, say: Callable[[str], None] | None = None) -> None:
    """Load the state dict file ``path`` into ``model``, a new head and an adapted stem where only
    those differ (``pretrained.fit_state``; torchvision weights names are resolved to their cached
    file by the driver, ``pretrained.resolve``)."""
    from raytrain_mp.pretrained import fit_state, read_state

    fit_state(model, read_state(path), str(path), say)
