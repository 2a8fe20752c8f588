"""Any image PIL opens, as uint8 pixels of a data set's channel count: the one conversion of image files.

Job: ``data prepare imagefolder:PATH`` (raw and ``--encoded``) and the loader's decoding of encoded
files (``data.encoded``) make a file's pixels here, so a file means the same pixels at prepare
(where the mean/std are computed) and in training, whatever its mode. The rules, in this order:

1. Depth, to 8 bits:
   - 16-bit gray (``I;16``, ``I;16L``, ``I;16B``, ``I;16N``; a 16-bit grayscale PNG opens as
     ``I;16``): ``value >> 8``, the full 0..65535 range onto 0..255 (257 * k -> k), not clipped;
   - 32-bit integer (``I``, e.g. a TIFF's): read as 16-bit samples, the range of PIL's 16-bit
     files, so clipped to 0..65535, then ``>> 8``;
   - float (``F``): in PIL's 8-bit units (``L`` converts to 0.0..255.0), clipped to 0..255 and the
     fraction dropped, as PIL's own F -> L; NaN is 0;
   - 16-bit RGB, RGBA and gray+alpha PNGs: PIL's decoder already keeps each sample's high byte,
     i.e. ``value >> 8`` as for 16-bit gray;
   - bilevel (``1``): 0 and 255.
2. Bands, to ``L`` (1 channel), ``RGB`` (3) or ``RGBA`` (4):
   - palette (``P``, ``PA``): the palette's colours, its transparency as alpha;
   - other colour spaces (``CMYK``, ``YCbCr``, ``LAB``, ``HSV``, ``RGBX``): PIL's conversion to RGB
     (CMYK without an ICC profile: R = (255 - C)(255 - K) / 255, rounded, and so on);
   - alpha is dropped, not composited (torchvision's ImageFolder loader does the same), and is 255
     where a 4-channel data set asks for it and the file has none;
   - gray to RGB repeats the gray; colour to gray is PIL's ITU-R 601-2 luma
     (L = R * 299/1000 + G * 587/1000 + B * 114/1000).

Invariants: the result is a function of the image's mode and samples only (no EXIF orientation,
ICC profile or gamma is applied, as before); ``to_uint8`` is ``to_uint8_image`` as an array of
shape (H, W, C); a mode with no conversion (premultiplied ``La``) is a ``ValueError`` naming it.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

CHANNEL_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
EIGHT_BIT = ("L", "LA", "RGB", "RGBA")  # modes that need only a band conversion


def _gray_to_uint8(image: Image.Image) -> Image.Image:
    """A one-band 16-bit, 32-bit integer or float image as 8-bit ``L`` (rule 1)."""
    samples = np.asarray(image)
    if image.mode in SIXTEEN_BIT:
        out = samples.astype(np.uint16) >> 8
    elif image.mode == "I":
        out = np.clip(samples, 0, 65535).astype(np.uint16) >> 8
    else:  # F
        out = np.clip(np.nan_to_num(samples, nan=0.0), 0.0, 255.0)
    return Image.fromarray(np.ascontiguousarray(out, dtype=np.uint8))  # 2-D uint8: L


def to_uint8_image(image: Image.Image, channels: int) -> Image.Image:
    """``image`` (any mode) as an 8-bit PIL image of ``channels`` bands: L, RGB or RGBA."""
    if channels not in CHANNEL_MODES:
        raise ValueError(f"{channels}-channel images: no image mode holds them; accepted: 1, 3 or 4 channels")
    target = CHANNEL_MODES[channels]
    mode = image.mode
    if mode in SIXTEEN_BIT or mode in ("I", "F"):
        image = _gray_to_uint8(image)
    elif mode in ("P", "PA"):
        image = image.convert("RGBA")  # via RGB, a palette's transparency in bytes would be dropped with a warning
    elif mode == "1":
        image = image.convert("L")
    elif mode not in EIGHT_BIT:
        try:
            image = image.convert("RGB")
        except ValueError as exc:
            raise ValueError(f"image mode {mode} has no conversion to 8-bit {target} ({exc})") from None
    return image if image.mode == target else image.convert(target)


def to_uint8(image: Image.Image, channels: int) -> np.ndarray:
    """``to_uint8_image`` as a writable uint8 array of shape (H, W, channels)."""
    pixels = np.array(to_uint8_image(image, channels), dtype=np.uint8)
    return pixels.reshape(pixels.shape[0], pixels.shape[1], channels)
