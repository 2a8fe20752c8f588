"""Data layer: Parquet shards of labelled images, their metadata, and a torch Dataset over them.

Part of the shared layer: every capability reads its data through this package. Modules: ``format``
(schema and metadata), ``sources`` (digits, synthetic, CIFAR-10, image folders), ``pixels`` (any
image file's mode to uint8 L/RGB/RGBA, the one conversion every reader of files uses), ``encoded``
(JPEG/PNG files: checked at prepare, decoded in the loader), ``prepare`` (sources to shards),
``dataset`` (the torch Dataset of uint8 samples), ``augment`` (the random draws, keyed by (seed,
epoch, index)), ``recipe_draws`` (the recipe's auto-augment, erasing and mixing, by torchvision
with keyed draws), ``transforms`` (the batch transforms on the training device), ``loader`` (loader
processes), ``default`` (the built-in data set), ``config`` (``PrepareConfig`` of ``raytrain-mp data
prepare``).

May import: ``raytrain_mp.config``, ``raytrain_mp.errors`` and ``raytrain_mp.storage``; no capability.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that a config (``data.config``) loads without torch or pyarrow.
_EXPORTS = {
    "DatasetMeta": "format",
    "ParquetImageDataset": "dataset",
    "default_dataset_dir": "default",
    "read_meta": "format",
    "resolve_dataset": "default",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
