"""The loaders ``bench data`` races: this project's per-sample path before issue 13, and torchvision's.

- ``PerSampleFloatDataset`` is ``ParquetImageDataset`` as it was: every sample normalized in
  float64 NumPy, padded, cropped and flipped one at a time in the loader, then cast to the model's
  dtype. Kept, unchanged, as the baseline the new uint8 path is measured against and as the
  reference the tests hold the device-side transforms to.
- ``torchvision_loader`` is what a user writes today for an image folder:
  ``torchvision.datasets.ImageFolder`` with PIL transforms (``RandomCrop`` with padding for raw-size
  images, ``RandomResizedCrop`` for the ImageNet recipe, horizontal flip, ``ToTensor``,
  ``Normalize``) in a ``DataLoader``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader

from raytrain_mp.data.dataset import ParquetImageDataset


class PerSampleFloatDataset(ParquetImageDataset):
    """Samples ``(image, label)``: image a (C, H, W) tensor of ``dtype``, label an int."""

    def __init__(self, *args, dtype: torch.dtype = torch.float32, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dtype = dtype
        self._mean = np.asarray(self.meta.mean, dtype=np.float64)
        self._std = np.asarray(self.meta.std, dtype=np.float64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:  # type: ignore[override]
        image = (self.raw_image(index) - self._mean) / self._std  # float64, HWC
        if self.augment:
            image = self._augmented(image, index)
        tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))).to(self.dtype)
        return tensor, int(self._labels[index])

    def _augmented(self, image: np.ndarray, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.epoch, index])
        h, w, _ = image.shape
        pad = max(1, max(h, w) // 8)
        padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
        top, left = rng.integers(0, 2 * pad + 1, size=2)
        image = padded[top : top + h, left : left + w]
        if rng.random() < 0.5:
            image = image[:, ::-1]
        return image


def torchvision_loader(
    folder: str, size: int, resized_crop: bool, batch_size: int, workers: int, policy: str | None = None
) -> DataLoader:
    """ImageFolder + PIL transforms + DataLoader over ``folder``: RandomResizedCrop(size) when
    ``resized_crop``, else RandomCrop(size, padding=size/8); then flip, the auto-augment
    ``policy`` if any (where torchvision's reference recipe puts it), ToTensor, Normalize."""
    from torchvision import datasets, transforms

    from raytrain_mp.data.recipe_draws import auto_augment

    crop = (
        transforms.RandomResizedCrop(size) if resized_crop else transforms.RandomCrop(size, padding=max(1, size // 8))
    )
    recipe = transforms.Compose(
        [
            crop,
            transforms.RandomHorizontalFlip(),
            *([auto_augment(policy)] if policy else []),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    dataset = datasets.ImageFolder(folder, transform=recipe)
    extra = {"persistent_workers": True} if workers > 0 else {}
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, **extra)
