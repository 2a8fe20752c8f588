"""``pipeline --compile`` end to end: compiled stages, over 2 replicas, crashed and resumed at a
step, train the eager single-replica run's model.

Two runs of a small network (``tests.tiny_models``, cut across its skip connection before
``body.1``; compiling ResNet-18's stages takes minutes here) in float64, 2 epochs of 4 steps of 32 at lr 0.2
on a 128/32 cut of digits: eager, 1 replica of 2 stages over 8 micro-batches, the reference; and
compiled, channels-last, 2 replicas of 2 stages over 4 micro-batches each (the same 8 micro-batches
in batch order: ``test_pipeline_replicas``), stage 1 failing once after global step 3 and the
stages rebuilt from the checkpoint at step 2. So one comparison holds compiling, the replica count
and a resume at a step together (``test_ddp_compile`` is the same for ddp); the rebuilt stages
read every graph they compiled at the first start from the compile cache.

Tolerance: compiling changes the order of floating point sums inside fused kernels, nothing else;
the bound is the fp64 tests' 1e-9, far below the 1e-3 a different computation moves these weights by.
"""

from __future__ import annotations

import pytest

from helpers import COMPILED_LINE, load_model_pt, max_abs_diff, run_cli_json, run_cli_json_and_text, write_digits_cut

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]  # two pipeline runs, one compiled


ARGS = [
    "pipeline", "--no-use-gpu", "--model", "tests.tiny_models:tiny_net", "--split-points", "body.1", "--stages", "2",
    "--schedule", "1f1b", "--precision", "fp64", "--epochs", "2", "--global-batch-size", "32", "--base-lr", "1.6",
    "--seed", "3", "--log-every", "0",
]  # fmt: skip


def test_compiled_replicas_resumed_at_a_step_train_the_eager_runs_model(tmp_path, compile_cache):
    data = write_digits_cut(tmp_path / "digits", 128, 32)
    marker = tmp_path / "crashed"
    common = [*ARGS, "--data", data, "--storage-path", str(tmp_path / "runs")]
    eager = run_cli_json(*common, "--name", "eager", "--microbatches", "8")
    compiled, text = run_cli_json_and_text(
        *common, "--name", "compiled", "--replicas", "2", "--microbatches", "4", "--compile", "--compile-cache",
        compile_cache, "--memory-format", "channels_last", "--max-failures", "1", "--checkpoint-every-steps", "2",
        "--inject-fault", f"1:s3:{marker}",
    )  # fmt: skip
    assert marker.read_text() == "killed stage 1 of replica 0 after step 3\n"
    assert "compiled/checkpoint_000001_step_000002 at epoch 1 step 3" in text  # the stages rebuilt from step 2
    assert compiled["epochs"] == eager["epochs"] == 2
    # each start's line sums its 4 stage actors; the rebuilt stages read every graph from the cache
    (first_hits, first_total, folder), (hits, total, _) = COMPILED_LINE.findall(text)
    assert folder == compile_cache and int(first_total) >= 4 and hits == total == first_total
    one, two = load_model_pt(eager), load_model_pt(compiled)
    assert list(one) == list(two)  # compiling changes no state-dict key
    assert max_abs_diff(one, two) < 1e-9
    assert compiled["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-9)
