"""How a run's images become its model's input: the data set's own normalization, or pretrained weights'.

``--preprocess`` takes ``data`` (the data set's per-channel mean/std at its own image size: what
every run without torchvision weights does), ``weights`` (the torchvision ``--weights``' own
``weights.transforms()``: its resize, crop, interpolation, mean and std) or the saved form of a
``Preprocess``, ``resize=256,crop=224,interpolation=bilinear,mean=0.485:0.456:0.406,std=...``, which
is what a run's ``config.yaml`` holds once the driver has resolved ``weights`` (so ``eval``,
``predict`` and a resumed run preprocess as the run trained, and ``--config`` reads it back).

With a ``Preprocess`` the batch on the training device is, in this order: the data set's stored
view (raw images at their prepared size, encoded ones as the loader decoded them), normalized by
the weights' mean/std (in [0, 1] units, so times 255 in the raw pixel units the loader yields),
the data set's augmentation (pad-crop and flip, ``--augment``), then Resize(``resize``) of the
shorter side with ``interpolation`` (antialiased, in float: torchvision's own pipeline rounds to
uint8 between its resize and its normalization, this one does not), and CenterCrop(``crop``):
the model's input is ``crop`` x ``crop``.

Invariants: torch-free (the command line validates ``--preprocess`` at parse time and ``--help``
must not wait for torch); ``str(Preprocess.parse(s)) == s`` for every saved form, so a run's
config.yaml reads back unchanged; a bad spec is one ``UsageError`` line naming the option.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raytrain_mp.errors import UsageError

INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic")  # torchvision's InterpolationMode values
KEYWORDS = ("data", "weights")
FORM = "data, weights, or resize=R,crop=C,interpolation=I,mean=M1:M2:M3,std=S1:S2:S3"


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """Resize(``resize``, ``interpolation``) + CenterCrop(``crop``) and normalization by ``mean``
    and ``std`` in [0, 1] pixel units (torchvision's), one value per channel."""

    resize: int
    crop: int
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __str__(self) -> str:
        values = {
            "resize": self.resize,
            "crop": self.crop,
            "interpolation": self.interpolation,
            "mean": ":".join(repr(v) for v in self.mean),
            "std": ":".join(repr(v) for v in self.std),
        }
        return ",".join(f"{k}={v}" for k, v in values.items())

    @classmethod
    def parse(cls, spec: str) -> Preprocess:
        """The ``Preprocess`` of its saved form; a ``UsageError`` naming ``--preprocess`` otherwise."""
        fields: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in {f.name for f in dataclasses.fields(cls)}:
                raise UsageError(f"--preprocess: cannot read {part!r} of {spec!r}; accepted: {FORM}")
            fields[key.strip()] = value.strip()
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in fields]
        if missing:
            raise UsageError(f"--preprocess: {spec!r} lacks {', '.join(missing)}; accepted: {FORM}")
        try:
            made = cls(
                int(fields["resize"]),
                int(fields["crop"]),
                fields["interpolation"],
                tuple(float(v) for v in fields["mean"].split(":")),
                tuple(float(v) for v in fields["std"].split(":")),
            )
        except ValueError:
            raise UsageError(f"--preprocess: {spec!r} has a value that is not a number; accepted: {FORM}") from None
        if made.interpolation not in INTERPOLATIONS:
            raise UsageError(
                f"--preprocess: unknown interpolation {made.interpolation!r}; accepted: {', '.join(INTERPOLATIONS)}"
            )
        if not (1 <= made.crop <= made.resize) or len(made.mean) != len(made.std) or min(made.std) <= 0:
            raise UsageError(
                f"--preprocess: {spec!r} needs 1 <= crop <= resize, as many means as stds, stds > 0; accepted: {FORM}"
            )
        return made

    @classmethod
    def of_transforms(cls, transforms: Any) -> Preprocess:
        """From torchvision's ``ImageClassification`` (what ``weights.transforms()`` returns)."""
        return cls(
            int(transforms.resize_size[0]),
            int(transforms.crop_size[0]),
            transforms.interpolation.value,
            tuple(float(v) for v in transforms.mean),
            tuple(float(v) for v in transforms.std),
        )

    def pixel_mean_std(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``mean`` and ``std`` in the raw 0..255 pixel units the loader's uint8 batches have."""
        return tuple(v * 255.0 for v in self.mean), tuple(v * 255.0 for v in self.std)


def check_syntax(spec: str | None) -> None:
    """``--preprocess``'s form, without the weights (``validate()`` runs at parse time)."""
    if spec is not None and spec not in KEYWORDS:
        Preprocess.parse(spec)


def of_spec(spec: str | None) -> Preprocess | None:
    """The run's ``Preprocess``, or None for the data set's own normalization (``data``, or none
    saved: a run from before ``--preprocess``). ``weights`` must have been resolved by the driver."""
    if spec is None or spec == "data":
        return None
    if spec == "weights":
        raise ValueError("--preprocess weights is resolved by the driver (pretrained.resolve_preprocess)")
    return Preprocess.parse(spec)


def input_size(spec: str | None, image_size: int) -> int:
    """The side of the model's input: the crop of a ``Preprocess``, else the data set's image size."""
    preprocess = of_spec(spec)
    return preprocess.crop if preprocess is not None else image_size


def input_hw(spec: str | None, height: int, width: int) -> tuple[int, int]:
    """(H, W) of the model's input for images of ``height`` x ``width``: a ``Preprocess``'s square
    crop, else the images' own."""
    preprocess = of_spec(spec)
    return (preprocess.crop, preprocess.crop) if preprocess is not None else (height, width)


def for_channels(preprocess: Preprocess | None, channels: int) -> Preprocess | None:
    """``preprocess`` for data of ``channels`` channels: the weights' own mean/std where the counts
    agree, else their averages repeated (a gray image is normalized as the mean of the weights'
    channels, which the stem adapted by summing its RGB filters expects)."""
    if preprocess is None or len(preprocess.mean) == channels:
        return preprocess
    mean, std = sum(preprocess.mean) / len(preprocess.mean), sum(preprocess.std) / len(preprocess.std)
    return dataclasses.replace(preprocess, mean=(mean,) * channels, std=(std,) * channels)
