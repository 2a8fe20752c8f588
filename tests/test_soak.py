"""The soak in the suite, small: ``scripts/soak.py``'s three trials with 2 random faults per trainer.

SIGKILLs from outside at seeded random moments of ``ddp`` workers (and the run's board) and of
``pipeline`` stage actors, each second kill followed by one during the restart it caused, in
float64 with step checkpoints, and a SIGKILLed ``pipeline`` driver rerun with its ``--name``: each
exits 0 and ends with the uninterrupted run's model (max abs diff <= 1e-9). The seed is
``RAYTRAIN_MP_SOAK_SEED`` (48 by default), so a failure reruns as it happened.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

SEED = int(os.environ.get("RAYTRAIN_MP_SOAK_SEED", "48"))
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_random_kills_of_workers_stage_actors_and_a_driver_leave_the_uninterrupted_model(tmp_path):
    soak = load_soak()
    trials = soak.soak(soak.prepare_data(tmp_path / "data"), str(tmp_path / "runs"), SEED, faults=2, epochs=2)
    print(soak.summary(trials))
    for trial in trials:
        assert trial.passed, (trial.name, trial.code, trial.kills, trial.max_abs_diff, trial.tail)
    # ddp: 2 random kills, 1 during the restart after the second, 1 of the board; pipeline: the same but the
    # board; 1 driver
    assert [len(trial.kills) for trial in trials] == [4, 3, 1], [trial.kills for trial in trials]
