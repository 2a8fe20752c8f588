"""``ddp --compile`` end to end: a compiled run trains the eager run's model, and every start after
the first reads its graphs from the compile cache.

Three fits of a small network (``tests.tiny_models``: compiling ResNet-18 would take minutes here)
in float64, 8 steps of 32 on a 128/32 cut of digits: eager on 1 worker, the single-process
reference; compiled on 2 workers, synchronized BatchNorm on, with ``--memory-format auto``,
crashing once after step 3 and restarting from the checkpoint at step 2 (so the one comparison
holds compiling, the worker count and a resume at a step together); and that run again with
``--epochs 3`` (a rerun of a finished ``--name``).

Tolerance: compiling changes the order of floating point sums inside fused kernels, nothing else;
in float64 over 8 steps at these learning rates that stays near 1e-15 (the bound is 1e-9, the fp64
DDP tests' bound, far below the 1e-3 a different computation moves these weights by).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import COMPILED_LINE, load_model_pt, max_abs_diff, run_cli_json, run_cli_json_and_text, write_digits_cut

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]  # three fits, two compiled

ARGS = [
    "ddp", "--no-use-gpu", "--num-workers", "2", "--model", "tests.tiny_models:tiny_net", "--precision", "fp64",
    "--epochs", "2", "--global-batch-size", "32", "--base-lr", "0.2", "--seed", "3", "--log-every", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, compile_cache) -> dict:
    root = tmp_path_factory.mktemp("compile")
    data = write_digits_cut(root / "digits", 128, 32)
    storage, marker = str(root / "runs"), root / "crashed"
    common = [*ARGS, "--data", data, "--storage-path", storage]
    compiled = [*common, "--name", "compiled", "--compile", "--compile-cache", compile_cache, "--memory-format", "auto"]
    eager, _ = run_cli_json_and_text(*common, "--name", "eager", "--num-workers", "1")
    crash = ["--max-failures", "1", "--checkpoint-every-steps", "2", "--inject-fault", f"1:s3:{marker}"]
    first, first_text = run_cli_json_and_text(*compiled, *crash)
    state = load_model_pt(first)  # before the rerun's checkpoints replace it
    train_state = torch.load(Path(first["checkpoint"]) / "train_state.pt", weights_only=False)
    rerun, rerun_text = run_cli_json_and_text(*compiled, "--epochs", "3")
    return {
        "data": data,
        "rerun_result": rerun,
        "checkpoint": rerun["checkpoint"],
        "eager": load_model_pt(eager),
        "compiled": state,
        "train_state": train_state,
        "first": first_text,
        "rerun": rerun_text,
        "marker": marker,
        "cache": compile_cache,
    }


def test_a_compiled_run_trains_the_eager_runs_model(runs):
    assert runs["marker"].exists()  # it crashed once and restarted
    assert runs["compiled"]["stem.0.weight"].dtype == torch.float64
    assert list(runs["compiled"]) == list(runs["eager"])  # compiling changes no state-dict key
    assert max_abs_diff(runs["eager"], runs["compiled"]) < 1e-9


def test_a_restart_and_a_rerun_read_every_graph_from_the_cache(runs):
    starts = COMPILED_LINE.findall(runs["first"])
    assert len(starts) == 2  # the first start, and the restart after the crash
    for hits, total, folder in [starts[1], *COMPILED_LINE.findall(runs["rerun"])]:
        assert int(total) > 0 and hits == total
        assert folder == runs["cache"]
    assert len(COMPILED_LINE.findall(runs["rerun"])) == 1


def test_auto_chooses_the_layout_once_and_the_checkpoint_carries_it(runs):
    chosen = re.findall(r"memory format: (channels_last|contiguous) \(", runs["first"])
    assert len(chosen) == 1  # measured on the first start only; the restart computes as it did
    assert runs["train_state"]["memory_format"] == chosen[0]
    assert "memory format:" not in runs["rerun"]


def test_eval_and_predict_compiled_give_the_runs_own_figures(runs, compile_cache, tmp_path):
    """eval --compile of the rerun's checkpoint reports the val loss its last epoch reported (the
    run evaluated through its compiled DDP model); predict --compile ranks PNG files as eager
    predict does, to the digit."""
    from PIL import Image

    from raytrain_mp.data import ParquetImageDataset

    compiled = ["--compile", "--compile-cache", compile_cache]
    out = str(tmp_path / "eval")
    evaluated = run_cli_json("eval", "--checkpoint", runs["checkpoint"], "--num-workers", "1", "--out", out, *compiled)
    assert evaluated["count"] == 32
    assert evaluated["loss"] == pytest.approx(runs["rerun_result"]["val_loss"], rel=1e-9)
    assert evaluated["accuracy"] == runs["rerun_result"]["val_accuracy"]
    val = ParquetImageDataset(runs["data"], "val")
    pngs = []
    for i in range(4):
        pngs.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(val.raw_image(i)[:, :, 0], "L").save(pngs[-1])
    eager = run_cli_json("predict", "--checkpoint", runs["checkpoint"], *pngs)["predictions"]
    fast = run_cli_json("predict", "--checkpoint", runs["checkpoint"], *pngs, *compiled)["predictions"]
    assert [p["classes"] for p in fast] == [p["classes"] for p in eager]
    for got, want in zip(fast, eager):
        assert got["probabilities"] == pytest.approx(want["probabilities"], rel=1e-9)
