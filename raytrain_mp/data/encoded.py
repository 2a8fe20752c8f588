"""Encoded images (JPEG, PNG bytes as stored in the shards): checked at prepare, decoded in the loader.

Job: the two ends of ``data prepare imagefolder:PATH --encoded``. At prepare, ``check_file`` reads
every file whole, so that a file that is not a JPEG or PNG, or is truncated, is named before
anything is written. In the loader processes, ``train_view`` and ``val_view`` decode one image with
``torchvision.io.decode_image`` and cut the ImageNet recipe's view of it as uint8 (3, S, S):
RandomResizedCrop(S) for training (its horizontal flip is left to ``data.transforms`` on the
device), Resize(S * 8/7) + CenterCrop(S) for evaluation (224 from 256, as the recipe has it).

Invariants: a view is a function of (bytes, S, seed, epoch, index) only (the crop comes from
``data.augment.resized_crop``); the checks use PIL because libjpeg, behind ``decode_image``, only
warns on a truncated JPEG and fills the rest grey, where PIL's full load raises.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as TF

from raytrain_mp.data.augment import resized_crop
from raytrain_mp.errors import UsageError

FORMATS = ("JPEG", "PNG")
VAL_RESIZE = 8 / 7  # the recipe's 256 / 224


def check_file(path: str | Path) -> np.ndarray:
    """The decoded uint8 (H, W, 3) pixels of a JPEG or PNG file; a ``UsageError`` naming it otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            if im.format not in FORMATS:
                raise UsageError(f"imagefolder: {path} is {im.format}, not JPEG or PNG; --encoded keeps JPEG and PNG files")
            im.load()  # decodes every byte: a truncated file raises here
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (OSError, UnidentifiedImageError, SyntaxError) as exc:
        raise UsageError(f"imagefolder: {path} is not a readable JPEG or PNG image ({exc})") from exc


def decode(data: bytes) -> torch.Tensor:
    """The image as uint8 (3, H, W), RGB whatever its stored mode."""
    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def train_view(data: bytes, size: int, seed: int, epoch: int, index: int) -> tuple[torch.Tensor, int]:
    """RandomResizedCrop(size) of the image, and its flip flag for the device."""
    image = decode(data)
    top, left, h, w, flip = resized_crop(seed, epoch, index, image.shape[1], image.shape[2])
    return TF.resized_crop(image, top, left, h, w, [size, size], antialias=True), flip


def val_view(data: bytes, size: int) -> torch.Tensor:
    """Resize(size * 8/7) of the shorter side, then CenterCrop(size)."""
    image = TF.resize(decode(data), [round(size * VAL_RESIZE)], antialias=True)
    return TF.center_crop(image, [size, size])
