"""Which Train run a trial fits, and from where (``tune.trainable.start_of``): its own newest run
when Tune restores it, a new run from a copy of another trial's checkpoint when PBT exploits one.
Real folders and Tune checkpoints; the trial's context is a stand-in (no Tune session runs here)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ray import tune

from raytrain_mp.tune.trainable import start_of


def context(trial_id: str, experiment: Path) -> SimpleNamespace:
    trial_dir = experiment / "tune" / f"run_trial_{trial_id}_1_base_lr=0.1"
    return SimpleNamespace(get_trial_id=lambda: trial_id, get_trial_dir=lambda: str(trial_dir))


def tune_checkpoint(experiment: Path, trial_id: str, number: int) -> tune.Checkpoint:
    folder = experiment / "tune" / f"run_trial_{trial_id}_1_base_lr=0.1" / f"checkpoint_{number:06d}"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(f"{trial_id} {number}".encode())
    return tune.Checkpoint.from_directory(folder)


def test_a_trial_continues_its_newest_run_and_forks_from_a_copy_of_another_trials_checkpoint(tmp_path):
    me = context("ab12c_00001", tmp_path)
    assert start_of(None, me, str(tmp_path)) == {"name": "train-ab12c_00001"}  # the first start
    for run in ("train-ab12c_00001", "train-ab12c_000010", "train-ab12c_00002"):  # not this trial's: 000010, 00002
        (tmp_path / run).mkdir()
    own = tune_checkpoint(tmp_path, "ab12c_00001", 3)
    assert start_of(own, me, str(tmp_path)) == {"name": "train-ab12c_00001"}  # restored: Ray Train continues it
    assert start_of(None, me, str(tmp_path)) == {"name": "train-ab12c_00001"}

    donor = tune_checkpoint(tmp_path, "ab12c_00002", 4)  # PBT: trial 2 was better
    fork = start_of(donor, me, str(tmp_path))
    start = tmp_path / "train-ab12c_00001-2-start"
    assert fork == {"name": "train-ab12c_00001-2", "resume_from": str(start)}
    assert (start / "model.pt").read_bytes() == b"ab12c_00002 4"  # a copy: the donor may delete its own
    (tmp_path / "train-ab12c_00001-2").mkdir()
    # the fork reported a checkpoint of its own; an interrupted sweep's resume continues the fork
    assert start_of(tune_checkpoint(tmp_path, "ab12c_00001", 5), me, str(tmp_path)) == {"name": "train-ab12c_00001-2"}
    # exploited again (here from the same trial's newer checkpoint): the third run
    again = start_of(tune_checkpoint(tmp_path, "ab12c_00002", 6), me, str(tmp_path))
    assert again["name"] == "train-ab12c_00001-3" and Path(again["resume_from"]).name == "train-ab12c_00001-3-start"
