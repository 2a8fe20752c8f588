"""Pretrained weights: a ``--weights`` name or file made into a local state dict, and fitted into the model.

``--weights`` takes a state dict file (a ``model.pt``, or any ``.pt``/``.pth`` torch saved) or the
name of torchvision weights of ``--model``: ``DEFAULT``, ``IMAGENET1K_V1``, or the full
``ResNet18_Weights.IMAGENET1K_V1`` (``torchvision.models.get_model_weights(model)`` lists them).
A name is read through torchvision's own cache: the file ``torch.hub.get_dir()/checkpoints/<the
URL's file name>`` (``TORCH_HOME/hub/checkpoints``), downloaded by ``Weights.get_state_dict(
progress=False, check_hash=True)`` when it is not there. torch checks the hash suffix of the file
name (``resnet18-f37072fd.pth``: the first digits of its SHA-256) only when it downloads a file,
never for a file already in the cache, so a file a user (or a test, from a seeded model) puts
there under that name is read as it is. The driver resolves a name once, before Ray starts
(``resolve``): a run then carries the cached file's absolute path, which its workers read (on a
cluster of several machines the cache must be on a shared file system, as the data set is).

``fit_state`` loads a state dict into a model built for the data set's classes and channels:

- every tensor whose key and shape match is loaded unchanged;
- the classifier head (``head_path``: the last ``nn.Linear`` or ``nn.Conv2d`` in module order,
  ``fc`` of a ResNet, ``classifier.3`` of MobileNet v3, ``heads.head`` of a ViT), where its shape
  differs (another class count), keeps the model's own fresh initialization, which the caller
  seeded (``--seed``);
- the stem (the first ``nn.Conv2d``), where only its input channels differ, is adapted: for one
  channel the RGB filters summed, for C channels the RGB filters repeated to C and scaled by 3 / C
  (timm's ``adapt_input_conv``), so a gray image of the mean brightness gives the same response;
- anything else that differs (a missing or extra key, another shape) is one ``UsageError`` line
  naming the first mismatch: the file fits neither the model nor the model with a new head.
  torchvision's auxiliary heads (GoogLeNet's ``aux1``/``aux2``, Inception's ``AuxLogits``), which
  the models here are built without, are left out as torchvision's own builders leave them out.

Invariants: nothing Ray-aware; torch and torchvision are imported when used, not with the module
(the command line checks ``--weights``' form at parse time); a head replacement and a stem
adaptation each say one line through ``say`` (the driver's check; the workers' builds say nothing).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from raytrain_mp.errors import UsageError
from raytrain_mp.preprocessing import Preprocess

if TYPE_CHECKING:
    from torch import nn

Say = Callable[[str], None]
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_NAME = re.compile(r"([A-Za-z_]\w*\.)?[A-Za-z_]\w*")
AUX_PREFIXES = ("aux1.", "aux2.", "AuxLogits.")
ACCEPTED = (
    "a state dict file (a model.pt) or torchvision weights of --model (DEFAULT, IMAGENET1K_V1, or the full "
    "ResNet18_Weights.IMAGENET1K_V1)"
)


def is_weights_file(spec: str) -> bool:
    """A file path, not a torchvision weights name: a path separator, a torch file suffix, or an existing file."""
    return os.sep in spec or "/" in spec or spec.endswith(FILE_SUFFIXES) or Path(spec).exists()


def check_syntax(spec: str) -> None:
    """``--weights``' form, without torch (``validate()`` runs at parse time): a name's letters, or a local file."""
    if "://" in spec:
        raise UsageError(f"--weights: {spec} is a URI; accepted: {ACCEPTED} (copy a file from the store first)")
    if is_weights_file(spec):
        if not Path(spec).expanduser().is_file():
            raise UsageError(f"--weights: no such file {spec}; accepted: {ACCEPTED}")
    elif not _NAME.fullmatch(spec):
        raise UsageError(f"--weights: {spec!r} is neither a file nor a weights name; accepted: {ACCEPTED}")


def torchvision_weights(model: str, spec: str) -> Any:
    """The ``WeightsEnum`` member ``spec`` names for torchvision model ``model``; one line naming
    the model's weights otherwise."""
    from torchvision import models as tv_models

    if ":" in model:
        raise UsageError(f"--weights: {spec} names torchvision weights, and --model {model} is your own network; "
                         "accepted: a state dict file for it")  # fmt: skip
    if model not in tv_models.list_models(module=tv_models):
        raise UsageError(f"--weights: {spec} names torchvision weights, and --model {model} is no torchvision model")
    enum = tv_models.get_model_weights(model)
    names = list(enum.__members__)
    enum_name, _, member = spec.rpartition(".")
    if (enum_name and enum_name != enum.__name__) or member not in enum.__members__:
        raise UsageError(
            f"--weights: {model} has no weights {spec!r}; accepted: {', '.join(names)} (or {enum.__name__}.NAME), "
            "or a state dict file"
        )
    return enum[member]


def cached_path(weights: Any) -> Path:
    """Where torchvision's cache keeps ``weights``: ``torch.hub.get_dir()/checkpoints/<the URL's file name>``."""
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)


def fetch(weights: Any, say: Say | None = None) -> Path:
    """The cached file of ``weights``, downloaded first when it is not in the cache (offline: one
    line naming the file and where to put it)."""
    path = cached_path(weights)
    if path.is_file():
        return path
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # torch's "Downloading: ..." line; ours follows
            weights.get_state_dict(progress=False, check_hash=True)
    except Exception as exc:  # URLError (offline), HTTPError, a hash mismatch (RuntimeError): one line each
        cause = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise UsageError(
            f"--weights: {weights} is not in torchvision's cache and could not be downloaded ({cause}); "
            f"put {weights.url} at {path} (TORCH_HOME/hub/checkpoints; TORCH_HOME sets where)"
        ) from None
    if say is not None:
        say(f"downloaded {weights} from {weights.url} to {path}")
    return path


def resolve(
    model: str, spec: str | None, preprocess: str | None, say: Say | None = None
) -> tuple[str | None, str | None]:
    """(``--weights`` as the absolute path of a local state dict file or None, the run's
    ``--preprocess`` spec): a torchvision name is fetched into the cache, and its
    ``weights.transforms()`` becomes the preprocessing unless ``--preprocess`` says otherwise."""
    if spec is None or is_weights_file(spec):
        if preprocess == "weights":
            raise UsageError(
                "--preprocess: weights takes the preprocessing of torchvision --weights (e.g. IMAGENET1K_V1); "
                "accepted here: data, or resize=...,crop=...,interpolation=...,mean=...,std=..."
            )
        path = None if spec is None else str(Path(spec).expanduser().resolve())
        return path, preprocess  # None stays None: a run without torchvision weights saves no preprocessing
    weights = torchvision_weights(model, spec)
    path = fetch(weights, say)
    if preprocess in (None, "weights"):
        preprocess = str(Preprocess.of_transforms(weights.transforms()))
    if say is not None:
        say(f"weights {weights} from {path}; preprocessing {preprocess}")
    return str(path), preprocess


def read_state(path: str | Path) -> dict:
    """The state dict in ``path``; one line naming it when it is none."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--weights: no such file {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a bad file
        raise UsageError(f"--weights: {path} is not a torch state dict ({type(exc).__name__})") from None
    if not isinstance(state, dict):
        raise UsageError(f"--weights: {path} holds a {type(state).__name__}, not a state dict")
    return state


def head_path(model: nn.Module) -> str:
    """The module path of the classifier head: the last ``nn.Linear`` or ``nn.Conv2d`` in module order."""
    from torch import nn

    paths = [path for path, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    if not paths:
        raise UsageError("--weights: the model has no nn.Linear or nn.Conv2d to serve as its classifier head")
    return paths[-1]


def stem_path(model: nn.Module) -> str:
    """The module path of the stem: the first ``nn.Conv2d`` in module order ('' when none)."""
    from torch import nn

    return next((path for path, m in model.named_modules() if isinstance(m, nn.Conv2d)), "")


def adapt_input_channels(weight: Any, channels: int) -> Any:
    """A conv weight (O, 3, kH, kW) for ``channels`` inputs: summed for one, else repeated and scaled by 3 / C."""
    if channels == 1:
        return weight.sum(dim=1, keepdim=True)
    repeats = math.ceil(channels / weight.shape[1])
    return weight.repeat(1, repeats, 1, 1)[:, :channels] * (weight.shape[1] / channels)


def _shape(tensor: Any) -> str:
    return "x".join(map(str, tensor.shape)) or "scalar"


def fit_state(model: nn.Module, state: dict, source: str, say: Say | None = None) -> None:
    """Load ``state`` into ``model``: matching tensors unchanged, a new head and an adapted stem
    where those differ (one line each through ``say``), else one ``UsageError`` naming the first mismatch."""
    own = model.state_dict()
    head, stem = head_path(model), stem_path(model)
    state = {k: v for k, v in state.items() if k in own or not k.startswith(AUX_PREFIXES)}
    fitted, new_head, adapted = {}, [], None
    for key, tensor in own.items():
        theirs = state.get(key)
        if theirs is None:
            _mismatch(source, model, head, f"{key} is missing from the file")
        if theirs.shape == tensor.shape:
            fitted[key] = theirs
        elif key.startswith(head + "."):
            new_head.append((key, theirs))
        elif (
            key == f"{stem}.weight"
            and theirs.ndim == 4
            and theirs.shape[1] == 3
            and theirs.shape[2:] == tensor.shape[2:]
        ):
            fitted[key] = adapt_input_channels(theirs, tensor.shape[1]).to(tensor.dtype)
            adapted = (key, theirs.shape[1], tensor.shape[1])
        else:
            small = key == f"{stem}.weight" and theirs.ndim == 4 and theirs.shape[2:] != tensor.shape[2:]
            hint = (
                "; a ResNet below 64 px gets the small stem, torchvision weights need --no-small-stem" if small else ""
            )
            _mismatch(
                source, model, head, f"{key} is {_shape(theirs)} in the file, {_shape(tensor)} in the model{hint}"
            )
    extra = next((k for k in state if k not in own), None)
    if extra is not None:
        _mismatch(source, model, head, f"{extra} is in the file, not in the model")
    for key, _ in new_head:
        fitted[key] = own[key]  # the model's own seeded initialization
    model.load_state_dict(fitted, strict=True)
    if say is not None and new_head:
        out = own[f"{head}.weight"].shape[0] if f"{head}.weight" in own else "?"
        was = new_head[0][1].shape[0]
        say(f"new head {head}: {out} classes, freshly initialized from --seed (the weights' head has {was})")
    if say is not None and adapted is not None:
        key, was, now = adapted
        rule = "the RGB filters summed" if now == 1 else f"the RGB filters repeated and scaled by 3/{now}"
        say(f"stem {key} adapted from {was} to {now} input channels ({rule})")


def _mismatch(source: str, model: nn.Module, head: str, what: str) -> None:
    raise UsageError(
        f"--weights: {source} fits neither the model nor the model with a new head ({head}): first mismatch: {what}"
    )
