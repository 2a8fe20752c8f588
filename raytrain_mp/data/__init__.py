"""Data layer: Parquet shards of labelled images, their metadata, and a torch Dataset over them."""

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
