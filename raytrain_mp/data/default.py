"""The built-in default data set: scikit-learn's digits, prepared once into a cache folder.

Invariant: resolving the default is idempotent and safe to race (several Ray workers on a node may
ask at once): the prepared folder appears by an atomic rename, and a loser of the race simply uses
the winner's identical, deterministic result. ``RAYTRAIN_MP_CACHE`` moves the cache folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from raytrain_mp.data.format import META_FILE
from raytrain_mp.data.prepare import prepare


def default_dataset_dir() -> Path:
    base = os.environ.get("RAYTRAIN_MP_CACHE") or Path.home() / ".cache" / "raytrain_mp"
    return Path(base) / "digits-v1"


def resolve_dataset(data: str | None) -> str:
    """The data set folder to train on: ``data`` itself, or the cached digits when it is None."""
    if data:
        return data
    folder = default_dataset_dir()
    if not (folder / META_FILE).is_file():
        try:
            prepare("digits", folder, overwrite=False, val_fraction=0.2, seed=0)
        except Exception:
            if not (folder / META_FILE).is_file():  # lost a race only if the winner's result is there
                raise
    return str(folder)
