"""Data layer: Parquet shards of labelled images, their metadata, and a torch Dataset over them.

Part of the shared layer: every capability reads its data through this package. Modules:
``format`` (schema and metadata), ``sources`` (digits, synthetic, CIFAR-10, image folders),
``prepare`` (sources to shards), ``dataset`` (the torch Dataset), ``default`` (the built-in data
set), ``config`` (``PrepareConfig`` of ``raytrain-mp data prepare``).

May import: ``raytrain_mp.config`` and ``raytrain_mp.errors``; no capability.
"""

from raytrain_mp.data.dataset import ParquetImageDataset
from raytrain_mp.data.default import default_dataset_dir, resolve_dataset
from raytrain_mp.data.format import DatasetMeta, read_meta
from raytrain_mp.data.prepare import prepare

__all__ = [
    "DatasetMeta",
    "ParquetImageDataset",
    "default_dataset_dir",
    "prepare",
    "read_meta",
    "resolve_dataset",
]
