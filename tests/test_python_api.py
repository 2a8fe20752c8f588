"""The Python API (docs/python.md): its examples run word for word, each in a fresh process with a
private HOME (the built-in digits prepared there) and working folder; then what they left is
checked. And the parts that need no Ray: the facade imports neither torch nor Ray, ``fit`` refuses
what is not a command's config, a trial's point names only ``DDPConfig`` options."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_mp.ddp.config import DDPConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
EXAMPLES = FENCE.findall(PAGE.read_text())


def run_example(code: str, tmp_path: Path) -> str:
    """``code`` as a user runs it on a machine of their own: a private HOME, working folder and Ray
    temp dir. The temp dir matters: a ``ray start`` of another test leaves its address in
    ``/tmp/ray/ray_current_cluster``, and a plain ``ray.init(num_cpus=2)`` joins that cluster and
    refuses ``num_cpus`` (as it would on a user's machine with a ``ray start`` running)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    temp_dir = Path(f"/tmp/rtpy-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    shutil.rmtree(temp_dir, ignore_errors=True)
    temp_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTRAIN_MP_CACHE")}
    env.update(HOME=str(home), TMPDIR=str(temp_dir), RAY_USAGE_STATS_ENABLED="0")
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=850
        )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def test_the_page_has_its_two_examples():
    assert len(EXAMPLES) == 2 and "fit(ddp)" in EXAMPLES[0] and "tune.Tuner(" in EXAMPLES[1]


@pytest.mark.slow
def test_fit_trains_a_ddp_and_a_pipeline_run_from_python(tmp_path):
    out = run_example(EXAMPLES[0], tmp_path)
    (ddp,) = re.findall(r"^ddp (\S+) (\S+)$", out, re.M)
    (pipeline,) = re.findall(r"^pipeline (\S+)$", out, re.M)
    assert 0 <= float(ddp[0]) <= 1 and 0 <= float(pipeline) <= 1
    runs = tmp_path / "work" / "runs"
    assert Path(ddp[1]) == runs / "ddp-from-python"
    assert sorted(p.name for p in runs.iterdir()) == ["ddp-from-python", "pipeline-from-python"]
    assert list((runs / "ddp-from-python").glob("checkpoint_*/model.pt"))


@pytest.mark.slow
def test_a_users_own_tuner_runs_pbt_over_our_trainable(tmp_path):
    out = run_example(EXAMPLES[1], tmp_path)
    (best,) = re.findall(r"^best (\{.*\}) (\S+) (\d+) (\S+)$", out, re.M)
    config = eval(best[0])  # the printed dict of the best trial's point
    assert set(config) == {"base_lr", "label_smoothing"} and config["label_smoothing"] in (0.0, 0.1)
    assert 0 <= float(best[1]) <= 1 and int(best[2]) == 3
    # at epoch 2 (synch) the worse trial exploited the better: a second run of its own from a copy of
    # the better trial's epoch-2 checkpoint, which trained epoch 3 under its perturbed lr
    runs = tmp_path / "work" / "sweep-runs"
    firsts = sorted(runs.glob("train-*_?????"))
    (fork,) = runs.glob("train-*-2")
    assert len(firsts) == 2 and all(list(run.glob("checkpoint_*/model.pt")) for run in firsts)
    assert (runs / f"{fork.name}-start" / "model.pt").is_file() and list(fork.glob("checkpoint_*/model.pt"))
    history = [
        json.loads(line)
        for line in (runs.parent / "sweeps" / "my-sweep")
        .glob(f"run_trial_{fork.name.split('-')[1]}_*/result.json")
        .__next__()
        .read_text()
        .splitlines()
    ]
    assert [row["epoch"] for row in history][-1] == 3 and history[-1]["run"] == fork.name
    assert {row["run"] for row in history} == {fork.name.removesuffix("-2"), fork.name}


def test_import_and_the_configs_load_neither_torch_nor_ray():
    code = (
        "import sys, raytrain_mp\n"
        "raytrain_mp.DDPConfig(epochs=1).validate(); raytrain_mp.PipelineConfig(epochs=1)\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_fit_refuses_what_is_not_a_commands_config_and_checks_before_ray():
    import ray

    from raytrain_mp import fit
    from raytrain_mp.errors import UsageError

    with pytest.raises(TypeError, match="fit takes a DDPConfig or a PipelineConfig, got dict"):
        fit({"epochs": 1})
    started = ray.is_initialized()
    with pytest.raises(UsageError, match=r"^--num-workers: must be >= 1, got 0$"):
        fit(DDPConfig(num_workers=0))
    assert ray.is_initialized() == started  # refused before any Ray was started


def test_a_trials_point_names_only_ddp_options():
    from raytrain_mp.tune.trainable import run_trial

    with pytest.raises(ValueError, match=r"^param_space: bogus, name not DDPConfig options; accepted: .*base_lr"):
        run_trial({"base_lr": 0.1, "bogus": 1, "name": "x"}, DDPConfig(), "runs")
