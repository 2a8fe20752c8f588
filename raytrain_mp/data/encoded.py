"""Encoded images (JPEG, PNG bytes as stored in the shards): checked at prepare, decoded in the loader.

Job: the two ends of ``data prepare imagefolder:PATH --encoded``. At prepare, ``check_file`` reads
every file whole, so that a file that is not a JPEG or PNG, or is truncated, is named before
anything is written. In the loader processes, ``train_view`` and ``val_view`` decode one image
(``decode``) and cut the ImageNet recipe's view of it as uint8 (3, S, S): RandomResizedCrop(S) for
training (its horizontal flip is left to ``data.transforms`` on the device), Resize(R) +
CenterCrop(S) for evaluation (``views`` says which S, R and interpolation a run has).

Invariants: a view is a function of (bytes, its sizes, interpolation, seed, epoch, index) only (the crop comes from
``data.augment.resized_crop``); the checks use PIL because libjpeg, behind ``decode_image``, only
warns on a truncated JPEG and fills the rest grey, where PIL's full load raises. Whatever a file's
mode (16-bit, palette, CMYK, alpha, bilevel), the pixels of ``check_file`` (which the data set's
mean/std are of) and of ``decode`` are the same 8-bit RGB, made by ``data.pixels``: ``decode`` lets
``torchvision.io.decode_image`` (about 1.8x PIL's speed) decode only the files where it gives
those very pixels, 8-bit gray or RGB JPEGs and 8-bit gray, RGB (with or without alpha) PNGs, and
PIL plus ``data.pixels`` the rest (a 16-bit PNG there would be uint16, which no batch of uint8
images collates with).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from raytrain_mp.data.augment import resized_crop
from raytrain_mp.data.pixels import to_uint8
from raytrain_mp.errors import UsageError
from raytrain_mp.views import Views

FORMATS = ("JPEG", "PNG")
CHANNELS = 3  # an encoded data set is RGB, whatever its files' modes
# (format, PIL mode) that decode_image turns into data.pixels' own pixels; a PNG's also 8-bit deep
NATIVE = {("JPEG", "L"), ("JPEG", "RGB"), ("PNG", "L"), ("PNG", "LA"), ("PNG", "RGB"), ("PNG", "RGBA")}


def check_file(path: str | Path) -> np.ndarray:
    """The decoded uint8 (H, W, 3) pixels of a JPEG or PNG file, as ``decode`` gives them; a
    ``UsageError`` naming it otherwise."""
    try:
        with Image.open(path) as im:
            if im.format not in FORMATS:
                raise UsageError(
                    f"imagefolder: {path} is {im.format}, not JPEG or PNG; --encoded keeps JPEG and PNG files"
                )
            im.load()  # decodes every byte: a truncated file raises here
            return to_uint8(im, CHANNELS)
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise UsageError(f"imagefolder: {path} is not a readable JPEG or PNG image ({exc})") from exc


def _native(data: bytes, image: Image.Image) -> bool:
    """Whether ``decode_image`` gives ``data.pixels``' pixels of this file: an 8-bit gray or RGB
    JPEG, or an 8-bit gray or RGB PNG with or without alpha (the IHDR's bit depth, byte 24)."""
    if (image.format, image.mode) not in NATIVE:
        return False
    return image.format == "JPEG" or data[24] == 8


def decode(data: bytes) -> torch.Tensor:
    """The image as uint8 (3, H, W): ``data.pixels``' RGB of it, whatever its stored mode."""
    with Image.open(io.BytesIO(data)) as image:  # reads the header only
        if not _native(data, image):
            pixels = to_uint8(image, CHANNELS)
            return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def train_view(
    data: bytes, size: int, seed: int, epoch: int, index: int, interpolation: str = "bilinear"
) -> tuple[torch.Tensor, int]:
    """RandomResizedCrop(size, interpolation) of the image, and its flip flag for the device."""
    image = decode(data)
    top, left, h, w, flip = resized_crop(seed, epoch, index, image.shape[1], image.shape[2])
    mode = InterpolationMode(interpolation)
    return TF.resized_crop(image, top, left, h, w, [size, size], interpolation=mode, antialias=True), flip


def val_view(data: bytes, views: Views) -> torch.Tensor:
    """Resize(``views.val_resize``, its interpolation) of the shorter side, then CenterCrop to ``views.val_hw``."""
    mode = InterpolationMode(views.interpolation)
    image = TF.resize(decode(data), [views.val_resize], interpolation=mode, antialias=True)
    return TF.center_crop(image, list(views.val_hw))
