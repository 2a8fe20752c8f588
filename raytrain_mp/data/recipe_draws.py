"""The recipe's random draws (torchvision's reference ``train.py``: auto-augment, random erasing,
mixup and cutmix), each a pure function of a key, made by torchvision's own transforms.

Job: give torchvision's ``transforms.v2`` a generator state that is a function of (seed, epoch,
index) for a per-sample draw or (seed, epoch, global step) for a per-step draw, and nothing else.
torchvision draws from torch's global generator, whose state in a loader process depends on how
many samples that process drew before, so the same sample would be augmented differently for
another number of workers or loader processes, or after a resume. Each draw here runs inside
``torch.random.fork_rng`` seeded by its key (``keyed``), so the transforms (and their pixels) are
torchvision's, bit for bit, and only the key is ours; the caller's generator is left as it was.

Streams keep the draws of one sample apart: the crop and flip of ``data.augment`` use
``numpy.random.default_rng([seed, epoch, index])``; these add a fourth word, one per kind of draw,
so turning one option on changes no other draw.

Mixing partners (``partner``): torchvision's ``MixUp``/``CutMix`` mix each sample of a batch with
its neighbour in that batch (``roll(1)``), so the pairs depend on how the global batch is split
into per-worker batches. Here sample ``i`` of epoch ``e`` is mixed with ``partner(seed, e, i, n)``,
another training sample drawn by key, which the same loader reads and augments (with that
sample's own draws of the epoch) beside it: every pair is the same for any sharding, at the cost of
reading and augmenting every training sample twice. One lambda (and, for cutmix, one box) per
global step, as the reference draws one per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms import v2

# The fourth word of a draw's key, one per kind of draw (``data.augment``'s crop and flip have three).
AUTO_AUGMENT, ERASE, PARTNER, MIX = 1, 2, 3, 4


def key(*words: int) -> int:
    """A 63-bit seed for torch's generator, a function of ``words`` only."""
    return int(np.random.default_rng(list(words)).integers(2**63))


@dataclass(frozen=True)
class Recipe:
    """The recipe's options that act on training samples: ``--auto-augment`` (a policy of
    ``POLICIES``, ``--ra-magnitude``, ``--augmix-severity``), ``--random-erase`` and whether the
    run mixes (``--mixup-alpha``/``--cutmix-alpha``: each sample then comes with its partner)."""

    auto_augment: str | None = None
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    @property
    def mixing(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def policy(self) -> v2.Transform | None:
        if self.auto_augment is None:
            return None
        return auto_augment(self.auto_augment, self.ra_magnitude, self.augmix_severity)


@contextmanager
def keyed(*words: int) -> Iterator[None]:
    """torch's CPU generator seeded by ``key(*words)`` inside, restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(key(*words))
        yield


def auto_augment(policy: str, magnitude: int = 9, severity: int = 3) -> v2.Transform:
    """The reference's ``--auto-augment`` policy (``ra`` with ``--ra-magnitude``, ``augmix`` with
    ``--augmix-severity``), with its default bilinear interpolation."""
    mode = v2.InterpolationMode.BILINEAR
    if policy == "ra":
        return v2.RandAugment(interpolation=mode, magnitude=magnitude)
    if policy == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=mode)
    if policy == "augmix":
        return v2.AugMix(interpolation=mode, severity=severity)
    return v2.AutoAugment(v2.AutoAugmentPolicy(policy), interpolation=mode)


def augmented(transform: v2.Transform, image: torch.Tensor, seed: int, epoch: int, index: int) -> torch.Tensor:
    """``transform`` of one uint8 (C, H, W) image with the draws of sample ``index`` of ``epoch``."""
    with keyed(seed, epoch, index, AUTO_AUGMENT):
        return transform(image)


def erase_box(p: float, shape: tuple[int, int, int], seed: int, epoch: int, index: int) -> tuple[int, int, int, int]:
    """(top, left, height, width) of ``v2.RandomErasing(p)``'s box for sample ``index`` of ``epoch``
    on a (C, H, W) image, or (0, 0, 0, 0) where it erases nothing; the box is drawn here (in the
    loader) and erased on the training device, after normalization (``erase``)."""
    eraser = v2.RandomErasing(p=p, value=0)
    with keyed(seed, epoch, index, ERASE):
        if torch.rand(1) >= p:  # _RandomApplyTransform.forward's own check, before its draws
            return 0, 0, 0, 0
        params = eraser.make_params([torch.empty(shape, dtype=torch.uint8)])
    return (params["i"], params["j"], params["h"], params["w"]) if params["v"] is not None else (0, 0, 0, 0)


def erase(images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Zero each image's box (N, 4) of ``erase_box`` in place; ``v2.functional.erase`` with value 0."""
    for image, (top, left, height, width) in zip(images, boxes.tolist()):
        if height:
            v2.functional.erase(image, top, left, height, width, torch.zeros(()), inplace=True)
    return images


def partner(seed: int, epoch: int, index: int, count: int) -> int:
    """The training sample that sample ``index`` of ``epoch`` is mixed with: any other of the ``count``."""
    return (index + 1 + int(np.random.default_rng([seed, epoch, index, PARTNER]).integers(count - 1))) % count


def pair_inputs(to_input: Callable, images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Model inputs (N, 2, C, H, W) of a loader's (sample, partner) items, ``images`` (N, 2, C, H, W)
    and ``params`` (N, 2, P), through the batch transform ``to_input`` (``dataset.BatchTransform``)."""
    return to_input(images.flatten(0, 1), params.flatten(0, 1)).unflatten(0, (len(images), 2))


@dataclass(frozen=True)
class Mix:
    """One global step's mixing: ``lam`` of each sample and ``1 - lam`` of its partner, over the
    whole image (mixup) or, for cutmix, outside the box (x1, y1, x2, y2), which holds the partner's
    pixels (``lam`` is then the share of the image outside it)."""

    lam: float
    box: tuple[int, int, int, int] | None = None

    def images(self, x: torch.Tensor, partner_x: torch.Tensor) -> torch.Tensor:
        """The mixed batch, as ``v2.MixUp``/``v2.CutMix`` compute a sample from its partner."""
        if self.box is None:
            return partner_x.mul(1.0 - self.lam).add_(x.mul(self.lam))
        x1, y1, x2, y2 = self.box
        out = x.clone()
        out[..., y1:y2, x1:x2] = partner_x[..., y1:y2, x1:x2]
        return out

    def targets(self, y: torch.Tensor, partner_y: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
        """Class probabilities (N, K): ``lam`` on each label, ``1 - lam`` on its partner's."""
        own, mate = (torch.nn.functional.one_hot(labels, num_classes).to(dtype) for labels in (y, partner_y))
        return mate.mul_(1.0 - self.lam).add_(own.mul(self.lam))


def step_mix(mixup_alpha: float, cutmix_alpha: float, size: tuple[int, int], seed: int, epoch: int, step: int) -> Mix:
    """The mixing of global ``step`` of ``epoch`` on images of ``size`` (H, W): mixup or cutmix
    (both on: one of them with probability 1/2, ``v2.RandomChoice``), its lambda and box drawn by
    ``v2.MixUp``/``v2.CutMix`` themselves."""
    choices: list[Callable[[], Mix]] = []
    if mixup_alpha > 0:
        mixup = v2.MixUp(alpha=mixup_alpha, num_classes=2)
        choices.append(lambda: Mix(mixup.make_params([])["lam"]))
    if cutmix_alpha > 0:
        cutmix = v2.CutMix(alpha=cutmix_alpha, num_classes=2)

        def cut() -> Mix:
            params = cutmix.make_params([torch.empty(1, 1, *size)])
            return Mix(params["lam_adjusted"], params["box"])

        choices.append(cut)
    with keyed(seed, epoch, step, MIX):
        weights = torch.tensor([1 / len(choices)] * len(choices))  # v2.RandomChoice's default p
        index = int(torch.multinomial(weights, 1)) if len(choices) > 1 else 0
        return choices[index]()
