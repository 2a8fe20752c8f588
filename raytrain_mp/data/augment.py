"""The random draws of data augmentation, each a pure function of (seed, epoch, index).

Job: decide, for one sample of one epoch, where to crop and whether to flip; nothing here touches
pixels. The loader processes call these (they are cheap), and the pixels are moved later, batched,
on the training device (``data.transforms``) or, for encoded images whose size differs per file,
at decode time in the loader (``data.encoded``).

Invariants:
- Every draw comes from ``numpy.random.default_rng([seed, epoch, index])``, so the same sample of
  the same epoch is augmented the same way in any process, for any number of workers or loader
  processes, and after a resume.
- ``pad_crop`` draws exactly as the per-sample path before it did (two offsets in [0, 2*pad], then
  a flip with probability 1/2), so models trained before keep reproducing.
- ``resized_crop`` is torchvision's ``RandomResizedCrop.get_params`` (scale (0.08, 1), ratio
  (3/4, 4/3), ten tries, then the center crop at the nearest allowed ratio), re-written because
  torchvision draws from torch's global generator, which is not keyed by (seed, epoch, index).
"""

from __future__ import annotations

import math

import numpy as np

PARAMS = 7  # per sample: crop top, crop left, flip (0 or 1), then random erasing's box: top, left, height, width
POLICIES = ("ra", "ta_wide", "augmix", "imagenet", "cifar10", "svhn")  # --auto-augment (data.recipe_draws)
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


def _rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, index])


def pad_width(height: int, width: int) -> int:
    """The zero padding around a raw image before its random crop: an eighth of its side, at least 1."""
    return max(1, max(height, width) // 8)


def pad_crop(seed: int, epoch: int, index: int, height: int, width: int) -> tuple[int, int, int]:
    """(top, left, flip) of a random ``height`` x ``width`` crop of the image padded by ``pad_width``."""
    rng = _rng(seed, epoch, index)
    pad = pad_width(height, width)
    top, left = rng.integers(0, 2 * pad + 1, size=2)
    return int(top), int(left), int(rng.random() < 0.5)


def resized_crop(seed: int, epoch: int, index: int, height: int, width: int) -> tuple[int, int, int, int, int]:
    """(top, left, crop height, crop width, flip) of RandomResizedCrop on a ``height`` x ``width`` image."""
    rng = _rng(seed, epoch, index)
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w, int(rng.random() < 0.5)
    aspect = width / height
    if aspect < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif aspect > RATIO[1]:
        h, w = height, int(round(height * RATIO[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w, int(rng.random() < 0.5)
