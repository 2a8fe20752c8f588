"""The images of ``raytrain-mp bench data``: its loader cases and the seeded photo crops they read.

Job: ``CASES`` (each loader case's side in pixels and whether its files are encoded) and
``make_images``, an ImageFolder of random crops of scikit-learn's two bundled photos, seeded, so
that every loader of a case, and the pipeline case, reads the same images.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CASES = {  # loader case name -> (side in pixels, encoded)
    "raw_32": (32, False),
    "raw_224": (224, False),
    "encoded_jpeg_224": (224, True),
}
VAL_FRACTION = 0.05  # of every case's images, as prepare splits them: round(count * VAL_FRACTION) to val
JPEG_QUALITY = 90
ENCODED_SIDES = (256, 400)  # encoded case: each file's sides are drawn from this range, as photos vary


def make_images(folder: Path, count: int, side: int | None, seed: int) -> Path:
    """An ImageFolder of ``count`` random crops of scikit-learn's sample photos in 2 classes (one per
    photo): PNG files of ``side`` x ``side`` when ``side`` is given, else JPEG files of random sizes."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    for i in range(count):
        label = i % len(photos)
        photo = photos[label]
        crop = int(rng.integers(160, min(photo.shape[:2]) + 1))
        top, left = (int(rng.integers(0, photo.shape[d] - crop + 1)) for d in (0, 1))
        image = Image.fromarray(photo[top : top + crop, left : left + crop])
        path = folder / f"photo{label}" / f"{i:05d}.{'png' if side else 'jpg'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if side:
            image.resize((side, side), Image.BILINEAR).save(path)
        else:
            w, h = (int(v) for v in rng.integers(*ENCODED_SIDES, size=2))
            image.resize((w, h), Image.BILINEAR).save(path, quality=JPEG_QUALITY)
    return folder
