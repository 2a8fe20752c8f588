"""Shared fixtures: one real local Ray instance per test session, started only by tests that ask.

The inner loop is ``pytest -m "not slow"`` (a few minutes); tests marked ``slow`` are the
end-to-end runs of a minute or more, and CI runs everything. Tests mirror the package's layout:
``tests/ddp``, ``tests/pipeline``, ``tests/tune``, ``tests/bench``, ``tests/data``, and the shared
layer and whole-project checks at the top.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from raytrain_mp.cluster import quiet_ray_train_logs

    if not ray.is_initialized():
        quiet_ray_train_logs()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    """The built-in default data set, prepared once for the session into a private cache."""
    from raytrain_mp.data import resolve_dataset

    cache = tmp_path_factory.mktemp("cache")
    os.environ["RAYTRAIN_MP_CACHE"] = str(cache)
    return resolve_dataset(None)
