"""A finished trial's saved state says it finished, whatever the timing of Tune's experiment saves.

Tune caches a trial's run metadata as JSON at each experiment save and sets ``done`` on the last
result in place when the trial's function returns; with an experiment save between the trial's last
report and its return, the state file kept the result without ``done`` and ``tune --resume`` counted
a finished sweep unfinished (CI, session 3). ``SaveFinishedResults`` is the fix; the test forces a
save in that gap (saves every second, a trial that waits 3 s after reporting)."""

from __future__ import annotations

import time

import pytest
from ray import tune

from raytrain_mp.tune.sweep import SaveFinishedResults

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.parametrize("callbacks, restored_done", [([], False), ([SaveFinishedResults()], True)])
def test_restored_results_of_a_finished_trial_carry_done(tmp_path, monkeypatch, callbacks, restored_done):
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "1")

    def _report_then_wait(config: dict) -> None:  # local, so the workers get it by value
        tune.report({"x": 1})
        time.sleep(3)

    run_config = tune.RunConfig(name="e", storage_path=str(tmp_path), callbacks=callbacks)
    live = tune.Tuner(_report_then_wait, run_config=run_config).fit()
    assert [result.metrics.get("done") for result in live] == [True]
    restored = tune.Tuner.restore(str(tmp_path / "e"), _report_then_wait).get_results()
    # Without the callback this shows Ray's bug; if Ray fixes it, drop the first case and the callback.
    assert [bool(result.metrics.get("done")) for result in restored] == [restored_done]
