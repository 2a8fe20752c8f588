"""Image files made into the model's input exactly as the run's validation split is.

Job: ``predict``'s FILE_OR_FOLDER arguments to uint8 (C, H, W) tensors that
``data.transforms.BatchTransform`` (the data set's mean/std) then normalizes, as the trainers'
evaluation does:

- an encoded data set (``meta.encoded``: JPEG/PNG kept as files): ``data.encoded.val_view``, the
  loader's own Resize + CenterCrop of the decoded RGB image, at the run's views (``views``); a file in another format
  PIL reads is converted to 8-bit RGB (``data.pixels``) and re-encoded losslessly as PNG first;
- a raw data set: converted to the data set's mode by ``data.pixels`` (as ``data prepare`` converts
  every file, 16-bit ones included: L for 1 channel, RGB for 3, RGBA for 4) and,
  when its size differs, resized to the stored H x W with PIL's bilinear filter, as
  ``data prepare imagefolder:PATH --image-size S`` resized it.

Invariants: every file is decoded whole here, before Ray starts, so a file that is not an image is
one ``UsageError`` line naming it; a folder contributes its image files (by extension, recursively,
sorted), and a folder with none is an error too.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from raytrain_mp.data.format import DatasetMeta
from raytrain_mp.data.pixels import CHANNEL_MODES, to_uint8_image
from raytrain_mp.errors import UsageError
from raytrain_mp.views import Views

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
OPTION = "FILE_OR_FOLDER"


def collect_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """The files named, and the image files inside the folders named, in the order given."""
    files: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        if "://" in given:
            raise UsageError(f"{OPTION}: {given} is a URI; accepted: local image files or folders")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
            if not found:
                raise UsageError(f"{OPTION}: {given} holds no image files ({', '.join(EXTENSIONS)})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{OPTION}: no such file or folder {given}")
    return files


def _open(path: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(path)
        image.load()  # decodes every byte: a truncated file raises here
        return image
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise UsageError(f"{OPTION}: {path} is not an image PIL can read ({type(exc).__name__})") from None


def load_image(path: Path, meta: DatasetMeta, views: Views | None = None) -> torch.Tensor:
    """The uint8 (C, H, W) view of ``path`` that the run's validation split would hold (``views``:
    the run's, ``TrainedRun.views``; None: the data set's own)."""
    from PIL import Image

    image = _open(path)
    h, w, c = meta.image_shape
    if meta.encoded:
        from raytrain_mp.data.encoded import val_view

        if image.format in ("JPEG", "PNG"):
            data = path.read_bytes()
        else:
            buffer = io.BytesIO()
            to_uint8_image(image, 3).save(buffer, format="PNG")
            data = buffer.getvalue()
        return val_view(data, views or Views.of(meta))
    if c not in CHANNEL_MODES:
        raise UsageError(f"{OPTION}: the model takes {c}-channel images, which no image file mode holds")
    try:
        image = to_uint8_image(image, c)
    except ValueError as exc:
        raise UsageError(f"{OPTION}: {path}: {exc}") from None
    if image.size != (w, h):
        image = image.resize((w, h), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.uint8).reshape(h, w, c)
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())
