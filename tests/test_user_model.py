"""A user's own network (``--model mymodels:tiny_net``, a module in the working directory) trains
end to end through the console script, with ``ddp`` on 2 workers, with ``tune`` on 1 and with
``pipeline`` on 2 stages cut across its skip connection; ddp and tune give the same model, and
``eval`` of the sweep's folder rebuilds its best trial's model through the same callable: world-size
invariance in float64 on a non-ResNet with BatchNorm (no dropout: dropout draws per rank, README
"Your model").

Three runs and an evaluation in all. Each is a ``raytrain-mp`` subprocess run from the folder that holds
``mymodels.py`` (the console script does not put that folder on ``sys.path``; the tool does), joined
to the session's Ray as a new job: Ray puts a job's working directory on its workers' ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import textwrap

import pyarrow.parquet as pq
import pytest
import torch

from helpers import max_abs_diff, write_digits_cut

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]  # three runs

MYMODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class TinyNet(nn.Module):
        """Conv-BN-ReLU, a residual Conv-BN-ReLU, global pooling, a linear head: BatchNorm, a
        forward that is not a chain (the pipeline cuts it from its traced graph), nothing random."""

        def __init__(self, num_classes, in_channels):
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
            )
            self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
            self.head = nn.Linear(16, num_classes)

        def forward(self, x):
            h = self.stem(x)
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.body(h) + h, 1), 1))


    def tiny_net(num_classes, in_channels, image_size):
        return TinyNet(num_classes, in_channels)
''')
FP64 = ["--precision", "fp64", "--epochs", "2", "--seed", "3", "--log-every", "0", "--no-use-gpu"]


def raytrain_mp(cwd, address: str, *argv: str) -> dict:
    done = subprocess.run(
        ["raytrain-mp", *argv, "--address", address, "--json"], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))


def test_a_user_module_trains_with_ddp_tune_and_pipeline(ray_session, tmp_path):
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    data = write_digits_cut(tmp_path / "digits", 640, 160)  # 5 steps of 128 an epoch
    address = ray_session.get_runtime_context().gcs_address
    common = ["--data", data, "--storage-path", str(tmp_path / "runs"), "--model", "mymodels:tiny_net", *FP64]
    ddp = raytrain_mp(
        tmp_path, address, "ddp", *common, "--name", "ddp", "--num-workers", "2", "--global-batch-size", "128",
        "--base-lr", "0.1",
    )  # fmt: skip
    assert ddp["epochs"] == 2 and ddp["world_size"] == 2 and ddp["val_count"] == 160 and 0 <= ddp["val_accuracy"] <= 1
    tune = raytrain_mp(
        tmp_path, address, "tune", *common, "--name", "tune", "--num-workers", "1", "--global-batch-sizes", "128",
        "--base-lrs", "0.1", "--scheduler", "none",
    )  # fmt: skip
    assert tune["trials_by_status"] == {"completed": 1}, tune
    pipeline = raytrain_mp(
        tmp_path, address, "pipeline", *common, "--name", "pipeline", "--stages", "2", "--split-points", "body.1",
        "--global-batch-size", "128", "--base-lr", "0.1",
    )  # fmt: skip
    # The cut falls between body's convolution and its BatchNorm: the skipped h crosses it too.
    assert [stage["blocks"][0] for stage in pipeline["stages"]] == ["stem.0", "body.1"] and pipeline["val_count"] == 160
    (trial_model,) = sorted((tmp_path / "runs" / "tune").glob("train-*/checkpoint_*/model.pt"))[-1:]
    # eval of the sweep's folder is its best trial's (here its only one's) newest checkpoint, the
    # model rebuilt through the same callable: exactly that trial's last validation.
    (row,) = pq.read_table(tune["table_parquet"]).to_pylist()
    assert row["run"] == trial_model.parent.parent.name
    evaluated = raytrain_mp(tmp_path, address, "eval", "--checkpoint", tune["experiment"], "--num-workers", "1",
                            "--out", str(tmp_path / "eval"))  # fmt: skip
    assert evaluated["checkpoint"] == str(trial_model.parent) and evaluated["count"] == 160
    assert evaluated["accuracy"] == row["final_val_accuracy"]

    # This file's mymodels, by path: another test's mymodels may sit in sys.modules under that name.
    spec = importlib.util.spec_from_file_location("user_mymodels", tmp_path / "mymodels.py")
    mymodels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mymodels)
    tiny_net = mymodels.tiny_net
    two = torch.load(ddp["model"], map_location="cpu", weights_only=True)
    one = torch.load(trial_model, map_location="cpu", weights_only=True)
    for model_pt in (ddp["model"], pipeline["model"]):
        state = torch.load(model_pt, map_location="cpu", weights_only=True)
        tiny_net(num_classes=10, in_channels=1, image_size=8).double().load_state_dict(state, strict=True)
        assert state["body.1.running_var"].dtype == torch.float64
    assert max_abs_diff(one, two) < 1e-9
