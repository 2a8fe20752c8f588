"""The recipe's options on training samples and the loss, shared by ``ddp`` and ``pipeline``.

Job: the fields (``--auto-augment``, ``--ra-magnitude``, ``--augmix-severity``, ``--random-erase``,
``--mixup-alpha``, ``--cutmix-alpha``, ``--label-smoothing``, ``--model-ema`` and its steps and
decay, ``--ra-sampler``/``--ra-reps``, the views' sizes and interpolation), their checks and the
``Recipe`` the sample options make, as a dataclass mixin a command's config inherits beside
``config.TrainOptions``. The views' checks against a data set are ``views``'.
Invariants: pure (no torch: the command line builds its parser from these); ``validate`` extends
the other bases' (cooperative ``super()``), so each check runs once, before any cluster resource.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from raytrain_mp.config import check, check_choice, option
from raytrain_mp.data.augment import POLICIES
from raytrain_mp.views import INTERPOLATIONS

if TYPE_CHECKING:
    from raytrain_mp.data.recipe_draws import Recipe

SAMPLE_FIELDS = ("auto_augment", "ra_magnitude", "augmix_severity", "random_erase", "mixup_alpha", "cutmix_alpha")


@dataclasses.dataclass
class RecipeOptions:
    """torchvision's reference recipe options, with its names and meanings."""

    label_smoothing: float = option(
        0.0, "the loss's label smoothing: the target puts this much mass uniformly over the classes (reference: 0.1)"
    )
    mixup_alpha: float = option(
        0.0, "mixup: each sample takes 1 - lambda of a partner sample, lambda ~ Beta(alpha, alpha) a step (0: off)"
    )
    cutmix_alpha: float = option(
        0.0, "cutmix: a box of each sample holds its partner's pixels (0: off; with --mixup-alpha: either, 1/2 each)"
    )
    auto_augment: str | None = option(None, "per-sample auto-augment policy, torchvision's (default: none)", POLICIES)
    ra_magnitude: int = option(9, "--auto-augment ra: the magnitude of its ops")
    augmix_severity: int = option(3, "--auto-augment augmix: the severity of its ops")
    random_erase: float = option(0.0, "probability of erasing a random box of each training image (reference: 0.25)")
    model_ema: bool = option(
        False,
        "keep an exponential moving average of the weights, evaluated every epoch (val_accuracy_ema) and saved as "
        "ema.pt in every checkpoint",
    )
    model_ema_steps: int = option(32, "update the weight average every this many steps of an epoch")
    model_ema_decay: float = option(
        0.99998,
        "the average's decay, adjusted as torchvision's reference does for --model-ema-steps, the batch and the epochs",
    )
    ra_sampler: bool = option(
        False, "repeated augmentation: an epoch reads each of its samples --ra-reps times, each copy augmented apart"
    )
    ra_reps: int = option(3, "--ra-sampler: copies of each sample an epoch reads")
    train_crop_size: int | None = option(
        None, "training view: RandomResizedCrop to this side (an encoded data set; default: its prepared size)"
    )
    val_resize_size: int | None = option(
        None, "validation view: the shorter side resized to this (an encoded data set; default: 8/7 of the crop)"
    )
    val_crop_size: int | None = option(
        None, "validation view: CenterCrop to this side (an encoded data set; default: its prepared size)"
    )
    interpolation: str | None = option(
        None, "the views' resizing (an encoded data set; default: bilinear)", INTERPOLATIONS
    )

    def validate(self) -> None:
        super().validate()  # type: ignore[misc]  # TrainOptions', next in a command config's bases
        check(0 <= self.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        for name in ("mixup_alpha", "cutmix_alpha"):
            check(getattr(self, name) >= 0, name, f"must be >= 0 (0: off), got {getattr(self, name)}")
        if self.auto_augment is not None:
            check_choice(self, "auto_augment")
        check(0 <= self.ra_magnitude <= 30, "ra_magnitude", f"must be in [0, 30], got {self.ra_magnitude}")
        check(1 <= self.augmix_severity <= 10, "augmix_severity", f"must be in [1, 10], got {self.augmix_severity}")
        check(0 <= self.random_erase <= 1, "random_erase", f"must be in [0, 1], got {self.random_erase}")
        check(self.model_ema_steps >= 1, "model_ema_steps", f"must be >= 1, got {self.model_ema_steps}")
        check(0 <= self.model_ema_decay <= 1, "model_ema_decay", f"must be in [0, 1], got {self.model_ema_decay}")
        check(self.ra_reps >= 1, "ra_reps", f"must be >= 1, got {self.ra_reps}")
        for name in ("train_crop_size", "val_resize_size", "val_crop_size"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, f"must be >= 1, got {value}")
        if self.interpolation is not None:
            check_choice(self, "interpolation")
        check(
            self.train_crop_size is None or self.augment,  # type: ignore[attr-defined]  # TrainOptions'
            "train_crop_size",
            "the training view is --augment's random crop; without it training takes the validation view "
            "(--val-crop-size); accepted: with --augment",
        )

    @property
    def repetitions(self) -> int:
        """Copies of each sample an epoch reads (``data.repeated``): ``--ra-reps`` with ``--ra-sampler``, else 1."""
        return self.ra_reps if self.ra_sampler else 1

    @property
    def recipe(self) -> Recipe:
        """The options that act on training samples (``data.recipe_draws``)."""
        from raytrain_mp.data.recipe_draws import Recipe

        return Recipe(**{name: getattr(self, name) for name in SAMPLE_FIELDS})
