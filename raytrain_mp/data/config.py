"""The validated ``PrepareConfig`` of ``raytrain-mp data prepare``.

Pure: no Ray, no writes; ``validate()`` runs before anything is read or written.
"""

from __future__ import annotations

import dataclasses

from raytrain_mp.config import check, check_writable, option


@dataclasses.dataclass
class PrepareConfig:
    source: str = option("digits", "digits | synthetic | cifar10:PATH | imagefolder:PATH")
    out: str = option("", "output folder (written atomically)")
    val_fraction: float = option(0.2, "share of samples held out for validation (digits, synthetic, imagefolder)")
    seed: int = option(0, "seed of the split and of synthetic images")
    rows_per_shard: int = option(10_000, "rows per Parquet shard")
    num_samples: int = option(2048, "synthetic: number of images")
    image_size: int | None = option(
        None,
        "synthetic: side in pixels (default 32); imagefolder: resize to this side; with --encoded: the side training "
        "crops to (default 224)",
    )
    encoded: bool = option(
        False, "imagefolder: keep each JPEG or PNG file as it is (decoded while training, ImageNet crops)"
    )
    num_classes: int = option(10, "synthetic: number of classes")
    channels: int = option(3, "synthetic: image channels")
    overwrite: bool = option(False, "replace --out if it exists")
    json: bool = False

    def validate(self) -> None:
        check(bool(self.out), "out", "an output folder is required")
        check_writable("out", self.out)
        check(0.0 < self.val_fraction < 1.0, "val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        check(self.rows_per_shard >= 1, "rows_per_shard", f"must be >= 1, got {self.rows_per_shard}")
        check(self.num_samples >= 2, "num_samples", f"must be >= 2, got {self.num_samples}")
        check(self.image_size is None or self.image_size >= 1, "image_size", f"must be >= 1, got {self.image_size}")
        check(self.num_classes >= 2, "num_classes", f"must be >= 2, got {self.num_classes}")
        check(
            not self.encoded or self.source.startswith("imagefolder:"),
            "encoded",
            f"applies to imagefolder:PATH only, got {self.source!r}",
        )
        check(self.channels in (1, 3), "channels", f"accepted: 1 or 3, got {self.channels}")
