"""The views a run cuts of its images: ``--train-crop-size``, ``--val-resize-size``,
``--val-crop-size`` and ``--interpolation``, resolved against the data set.

Job: one place that says what size the loader hands the model in training and in evaluation, for
the loops, ``eval``, ``predict`` and ``export`` alike. The options mean what torchvision's reference
``train.py`` means by them: an encoded data set's (JPEG/PNG files, ``data prepare --encoded``)
training view is RandomResizedCrop(train crop) and its validation view Resize(val resize) of the
shorter side + CenterCrop(val crop), all with ``interpolation`` (antialiased); training at a smaller
crop than evaluation is the recipe's "FixRes" effect (ResNet-50: 176 in training, 232 -> 224 in
evaluation).

Invariants:
- Defaults are the data set's prepared size S for both crops and round(val crop * 8/7) for the
  resize (224 from 256), bilinear: a run that names none of the options cuts what it always cut.
- A raw data set is stored at its training size and is never resized by the loader: a crop other
  than its own size, a resize or an interpolation there is a one-line ``UsageError`` naming the
  option, before any cluster resource, so a run's views are never silently other than it asked.
- Pure and torch-free: the command line and the drivers resolve views before workers exist; a
  run's ``config.yaml`` holds the options, and a run saved before them resolves to the defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from raytrain_mp.errors import UsageError

FIELDS = ("train_crop_size", "val_resize_size", "val_crop_size", "interpolation")
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")  # the reference's --interpolation choices
DEFAULT_INTERPOLATION = "bilinear"
VAL_RESIZE = 8 / 7  # the recipe's 256 / 224


@dataclasses.dataclass(frozen=True)
class Views:
    """(H, W) of the model's training and validation images as the loader cuts them, and, for an
    encoded data set, the validation resize and the interpolation of both views."""

    train_hw: tuple[int, int]
    val_hw: tuple[int, int]
    val_resize: int
    interpolation: str = DEFAULT_INTERPOLATION

    @classmethod
    def of(cls, meta: Any, options: Any = None) -> Views:
        """The views of a run over the data set ``meta`` with ``options`` (a config with the
        ``FIELDS``, or a run's ``config.yaml`` mapping; None or missing fields: the defaults)."""
        given = {name: _get(options, name) for name in FIELDS}
        h, w, _ = meta.image_shape
        if not meta.encoded:
            for name, value in given.items():
                stored_size = name.endswith("crop_size") and value == h == w
                if value is not None and not stored_size:
                    raise UsageError(
                        f"--{name.replace('_', '-')}: the data set is raw pixels stored at its training size "
                        f"{h}x{w}, which the loader never resizes; accepted: {h if h == w else 'none'} for a crop, "
                        "or prepare the images with `data prepare --encoded` to cut views of any size"
                    )
            return cls((h, w), (h, w), 0)
        train = given["train_crop_size"] or meta.image_size
        crop = given["val_crop_size"] or meta.image_size
        resize = given["val_resize_size"] or round(crop * VAL_RESIZE)
        if crop > resize:
            raise UsageError(
                f"--val-crop-size: {crop} is larger than the validation resize {resize} it is cut from; accepted: "
                f"at most --val-resize-size"
            )
        return cls((train, train), (crop, crop), resize, given["interpolation"] or DEFAULT_INTERPOLATION)

    def training_hw(self, augment: bool) -> tuple[int, int]:
        """(H, W) of the training images: the training view with ``--augment`` (its random crop),
        else the validation view, which an encoded data set then trains on too."""
        return self.train_hw if augment else self.val_hw

    def training_size(self, augment: bool) -> int:
        """The side the model is built for (``models``' small-stem choice): the training images' longer."""
        return max(self.training_hw(augment))


def _get(options: Any, name: str) -> Any:
    if options is None:
        return None
    return options.get(name) if isinstance(options, Mapping) else getattr(options, name, None)
