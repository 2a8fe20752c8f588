"""Smoke tests of ``raytrain-mp bench pipeline|ddp|data`` at tiny sizes: the JSON schema, every figure
positive and finite, the plots written. No timing is asserted: the machine is shared."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_readme import readme_commands

from helpers import assert_usage_error, run_cli, run_cli_json

# Figures that may be zero: a share of idle time, a distance from a formula, or the bubble a
# one-stage layout (the hybrid case's pure data parallel) has by the formula; the loss difference
# of two runs that train on the same samples.
MAY_BE_ZERO = (
    "bubble_fraction",
    "bubble_gap",
    "index",
    "bubble_formula",
    "bubble_for_stage_times",
    "niceness",
    "loss_difference",
    "graphs_from_cache",  # a cold compile reads none
    "graphs_compiled",  # a warm one compiles none
)


def figures(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf that is not a string or a boolean."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from figures(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from figures(value, f"{path}[{index}]")
    elif not isinstance(obj, (str, bool)):
        yield path, obj


def assert_figures_positive(results: dict) -> None:
    """Every measured figure (settings and machine aside) is a finite number, positive unless it is
    a fraction that may be zero; only an unprofiled stage's ``seconds`` and ``forward_seconds`` may be None."""
    measured = {k: v for k, v in results.items() if k not in ("settings", "machine")}
    checked = 0
    for path, value in figures(measured):
        if value is None:
            assert path.endswith((".seconds", ".forward_seconds")) and ".plan[" in path, path
            continue
        assert isinstance(value, (int, float)) and math.isfinite(value), (path, value)
        assert value >= 0 if any(tag in path for tag in MAY_BE_ZERO) else value > 0, (path, value)
        checked += 1
    assert checked > 0


def assert_machine(results: dict) -> None:
    machine = results["machine"]
    assert machine["cpu_count"] >= 1 and isinstance(machine["gpus"], list)
    assert machine["torch"] and machine["ray"]
    assert len(machine["load_average_start"]) == 3 and len(machine["load_average_end"]) == 3


def assert_spread(figure: dict) -> None:
    assert set(figure) == {"median", "min", "max"}
    assert figure["min"] <= figure["median"] <= figure["max"]


# The README's tiny bench (docs/performance.md shows it too): this test is where it runs.
TINY_BENCH = next(
    command for command in readme_commands() if command.startswith("raytrain-mp bench pipeline --out bench-tiny ")
)


@pytest.mark.slow
def test_bench_pipeline_smoke(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its --out is relative, as a reader types it
    summary = run_cli_json(*shlex.split(TINY_BENCH)[1:], "--no-use-gpu")
    out = tmp_path / "bench-tiny"
    results = json.loads((out / "results.json").read_text())
    assert (tmp_path / summary["results"]).resolve() == out / "results.json"
    assert [Path(plot).name for plot in summary["plots"]] == ["step_time_bars.png", "m_curve.png", "overhead.png"]
    for plot in summary["plots"]:
        assert Path(plot).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert_machine(results)
    assert results["settings"]["microbatches"] == [1, 2]
    local = results["one_process"]
    assert [f["microbatches"] for f in [local["whole_batch"], *local["grad_accum"]]] == [1, 2]
    assert (local["device"], results["native"]["device"], results["settings"]["use_gpu"]) == ("cpu", "cpu", False)
    assert set(results["layouts"]) == {"fixed", "balanced", "interleaved"}
    expected = {
        "fixed": {("gpipe", 1), ("gpipe", 2), ("1f1b", 2)},
        "balanced": {("gpipe", 1), ("gpipe", 2)},
        "interleaved": {("interleaved-1f1b", 1), ("interleaved-1f1b", 2)},
    }
    for name, layout in results["layouts"].items():
        virtual = 2 if name == "interleaved" else 1
        assert len(layout["plan"]) == 2 * virtual
        runs = {(r["schedule"], r["microbatches"]) for r in layout["runs"]}
        assert runs == expected[name], name  # 1F1B needs m >= stages; the balanced layout runs GPipe only
        trials = layout["balance_trials"]  # the profile's cut, then the rescaled profile's while new
        assert len(trials) == 0 if name == "fixed" else 1 <= len(trials) <= 3
        if trials:
            fastest = min(trials, key=lambda trial: trial["bubble_fraction"])["split_points"]
            assert [stage["blocks"][0] for stage in layout["plan"][1:]] == fastest
        for run in layout["runs"]:
            assert_spread(run["step_seconds"])
            assert_spread(run["queued_step_seconds"])
            # the layer3 split runs in --resnet-rounds 2 against native, its --steps 1 pooled
            assert (
                len(run["samples"]["step_seconds"])
                == len(run.get("round_medians", {}).get("step_seconds", [0]))
                == (2 if name == "fixed" else 1)
            )
            assert 0 <= run["queued_bubble_fraction"]["min"] and run["queued_bubble_fraction"]["max"] < 1
            assert len(run["busy_seconds"]) == 2
            # --memory-format auto: per actor, each stage's layout as measured at this point
            assert [len(stages) for stages in run["memory_formats"]] == [virtual, virtual]
            assert {layout for stages in run["memory_formats"] for layout in stages} <= {"channels_last", "contiguous"}
            assert len(run.get("peak_activation_bytes", [0, 0])) == 2 and ("peak_activation_bytes" in run) == (
                virtual == 1
            )
            assert run["bubble_formula"] == 1 / (virtual * run["microbatches"] + 1)
            assert ("bubble_for_stage_times" in run) == (virtual == 1)
            assert 0 <= run.get("bubble_for_stage_times", 0) < 1
    assert results["layouts"]["fixed"]["plan"][1]["blocks"][0] == "layer3.0.conv1"  # the layer3 split
    balanced_trials = results["layouts"]["balanced"]["balance_trials"]
    assert results["summary"]["balanced_trial_bubbles"] == {
        ",".join(t["split_points"]): t["bubble_fraction"] for t in balanced_trials
    }
    assert [(s["schedule"], s["microbatches"]) for s in results["layouts"]["fixed"]["skipped"]] == [("1f1b", 1)]
    gpipe2, one_f2 = (
        next(r for r in results["layouts"]["fixed"]["runs"] if r["schedule"] == s and r["microbatches"] == 2)
        for s in ("gpipe", "1f1b")
    )
    # 1F1B's last stage holds one micro-batch where GPipe holds both.
    assert one_f2["peak_activation_bytes"][1] < gpipe2["peak_activation_bytes"][1]
    assert_native(results)
    assert_overhead(results, summary)
    assert_hybrid(results, summary)
    assert_figures_positive(results)


def assert_hybrid(results: dict, printed: dict) -> None:
    """k=2 actors: pure data parallel (2 replicas of 1 stage) and pure pipeline (1 replica of 2
    stages) on the same global batch in 4 micro-batches in all, each actor's busy time measured."""
    hybrid = results["hybrid"]
    assert (hybrid["workers"], hybrid["microbatches"]) == (2, 4)
    layouts = [(r["replicas"], r["stages"], r["microbatches"], len(r["busy_seconds"])) for r in hybrid["runs"]]
    assert layouts == [(2, 1, 2, 2), (1, 2, 4, 2)]
    for run in hybrid["runs"]:
        assert_spread(run["step_seconds"])
        assert run["samples_per_second"] == pytest.approx(8 / run["step_seconds"]["median"])
    seconds = {f"R{r['replicas']}xS{r['stages']}": r["step_seconds"]["median"] for r in hybrid["runs"]}
    assert results["summary"]["hybrid_seconds"] == printed["hybrid_seconds"] == seconds


def assert_overhead(results: dict, printed: dict) -> None:
    """The overhead case ran the 3-layer MLP on 2 stages, ours and native at every m the schedule
    allows, and compares them point by point and at m=8 in the summary."""
    overhead = results["overhead"]
    assert set(overhead) == {
        "model",
        "batch_size",
        "stages",
        "warmup",
        "steps",
        "steps_per_call",
        "rounds",
        "layouts",
        "runs",
        "skipped",
        "native",
    }
    assert (
        overhead["batch_size"],
        overhead["stages"],
        overhead["steps"],
        overhead["steps_per_call"],
        overhead["rounds"],
    ) == (64, 2, 2, 8, 1)
    # 4 Linear layers, so that 2 stages x 2 virtual stages get one each; the stage actors run at
    # torchrun's niceness (this suite runs as root, which may lower Ray's 15)
    niceness = [0, 0] if os.geteuid() == 0 else [15, 15]
    assert overhead["layouts"] == [
        {"virtual_stages": 1, "split_points": ["4+5"], "schedules": ["gpipe", "1f1b"], "stage_niceness": niceness},
        {
            "virtual_stages": 2,
            "split_points": ["2+3", "4+5", "6"],
            "schedules": ["interleaved-1f1b"],
            "stage_niceness": niceness,
        },
    ]
    assert overhead["native"]["backend"] in ("gloo", "nccl") and overhead["native"]["world"] == 2
    runs = {(r["schedule"], r["microbatches"]): r for r in overhead["runs"]}
    # m sorted; 1F1B needs m >= stages
    assert list(runs) == [("gpipe", 1), ("gpipe", 8), ("1f1b", 8), ("interleaved-1f1b", 1), ("interleaved-1f1b", 8)]
    skipped = [(s["side"], s["schedule"], s["microbatches"]) for s in overhead["skipped"]]
    assert skipped == [("ours", "1f1b", 1), ("native", "1f1b", 1)]
    keys = {
        "schedule",
        "microbatches",
        "virtual_stages",
        "ours_ms",
        "ours_in_ranks_ms",
        "ours_queued_ms",
        "native_ms",
        "native_queued_ms",
        "native_over_ours",
        "native_over_ours_in_ranks",
        "native_over_ours_queued",
        "native_over_ours_queued_by_round",
        "bubble_fraction",
        "bubble_formula",
    }
    for (schedule, m), run in runs.items():
        virtual = 2 if schedule.startswith("interleaved") else 1
        assert set(run) == keys and run["virtual_stages"] == virtual
        for figure in (
            "ours_ms",
            "ours_in_ranks_ms",
            "ours_queued_ms",
            "native_ms",
            "native_queued_ms",
            "bubble_fraction",
        ):
            assert_spread(run[figure])
        assert run["ours_in_ranks_ms"]["median"] <= run["ours_ms"]["median"]  # the rank's part of the call
        assert 0 <= run["bubble_fraction"]["min"] and run["bubble_fraction"]["max"] < 1
        assert run["bubble_formula"] == (2 - 1) / (virtual * m + 2 - 1)
        ratios = (
            ("native_over_ours", "native_ms", "ours_ms"),
            ("native_over_ours_in_ranks", "native_ms", "ours_in_ranks_ms"),
            ("native_over_ours_queued", "native_queued_ms", "ours_queued_ms"),  # both back to back, 8 steps a group
        )
        for ratio, theirs, ours in ratios:
            assert math.isfinite(run[ratio]) and run[ratio] > 0
            assert math.isclose(run[ratio], run[theirs]["median"] / run[ours]["median"])
        # one round (the layer3 split pools two through the same ``pooled``): its ratio
        by_round = run["native_over_ours_queued_by_round"]
        assert len(by_round) == 1 and all(math.isfinite(r) and r > 0 for r in by_round)
    for key in ("native_over_ours", "native_over_ours_queued"):
        at8 = {schedule: runs[schedule, 8][key] for schedule in ("gpipe", "1f1b", "interleaved-1f1b")}
        assert results["summary"][f"overhead_{key}"] == printed[f"overhead_{key}"] == at8
    settings = results["settings"]
    assert settings["overhead"] is True and settings["overhead_schedules"] == ["gpipe", "1f1b", "interleaved-1f1b"]


def assert_native(results: dict) -> None:
    """torch.distributed.pipelining ran on the layer3 split under torchrun, the model as given and
    (--memory-format auto, the default) each stage in the layout ours measured faster at that
    point: GPipe at every m, 1F1B where the API allows it (m >= stages), each measured pair
    compared with ours."""
    measured = {("gpipe", 1), ("gpipe", 2), ("1f1b", 2)}
    for side in ("native", "native_ours_layouts"):
        native = results[side]
        assert native["api"].startswith("torch.distributed.pipelining")
        assert native["backend"] in ("gloo", "nccl") and native["world"] == 2 and native["threads"] == 1
        assert native["split"] == "fixed"
        assert {(r["schedule"], r["microbatches"]) for r in native["runs"]} == measured
        for run in native["runs"]:
            assert set(run) == {
                "schedule",
                "microbatches",
                "step_seconds",
                "samples",
                "samples_per_second",
                "round_medians",
            }
            assert_spread(run["step_seconds"])
            # --steps 1 in each of --resnet-rounds 2: the rounds' medians are the pooled samples
            assert (
                run["samples"]["step_seconds"] == run["round_medians"]["step_seconds"]
                and len(run["round_medians"]["step_seconds"]) == 2
            )
            assert run["samples_per_second"] == pytest.approx(8 / run["step_seconds"]["median"])
        (skip,) = native["skipped"]
        assert (skip["schedule"], skip["microbatches"]) == ("1f1b", 1) and "stages" in skip["reason"]
    summary = results["summary"]
    ratios_of = (
        ("ours_over_native", "native", "step_seconds"),
        ("ours_queued_over_native", "native", "queued_step_seconds"),
        ("ours_over_native_ours_layouts", "native_ours_layouts", "step_seconds"),
    )
    for key, side, figure in ratios_of:
        ratios = summary[key]
        assert {(s, int(m)) for s, by_m in ratios.items() for m in by_m} == measured
        for schedule, by_m in ratios.items():
            for m, ratio in by_m.items():
                native_run = next(
                    r for r in results[side]["runs"] if r["schedule"] == schedule and r["microbatches"] == int(m)
                )
                ours = next(
                    r
                    for r in results["layouts"]["fixed"]["runs"]
                    if r["schedule"] == schedule and r["microbatches"] == int(m)
                )
                assert math.isclose(ratio, native_run["step_seconds"]["median"] / ours[figure]["median"])
                if key == "ours_over_native":
                    rounds = zip(
                        native_run["round_medians"]["step_seconds"], ours["round_medians"]["step_seconds"], strict=True
                    )
                    assert summary["ours_over_native_by_round"][schedule][m] == [theirs / own for theirs, own in rounds]
    native = results["native"]
    assert (summary["best_native"]["schedule"], summary["best_native"]["microbatches"]) in measured
    assert summary["best_native_seconds"] == min(
        r["step_seconds"]["median"] for r in native["runs"] if r["microbatches"] > 1
    )


@pytest.mark.slow
def test_bench_ddp_smoke(ray_session, tmp_path):
    """With --compile, on a small network (``tests.tiny_models``: compiling ResNet-18 takes minutes
    here): both sides eager and compiled, ours again from the cache it filled."""
    out = tmp_path / "ddp"
    summary = run_cli_json(
        "bench", "ddp", "--no-use-gpu", "--out", str(out), "--image-size", "8", "--batch-size-per-worker", "4",
        "--num-workers", "1", "--steps", "2", "--warmup", "1", "--model", "tests.tiny_models:tiny_net", "--compile",
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert Path(summary["plots"][0]).stat().st_size > 0
    assert_machine(results)
    assert results["ray_running_during_bare"] is True  # the test session's Ray was up
    sides = ("bare_torchrun", "ray_train", "bare_torchrun_compiled", "ray_train_compiled", "ray_train_compiled_warm")
    for side in sides:
        assert [r["workers"] for r in results[side]] == [1]  # one worker count keeps it to three Ray fits
        for run in results[side]:
            assert_spread(run["step_seconds"])
            assert_spread(run["samples_per_second"])
            assert run["first_step_seconds"] > 0
    cold, warm = results["ray_train_compiled"][0], results["ray_train_compiled_warm"][0]
    assert cold["graphs_compiled"] > 0 and results["bare_torchrun_compiled"][0]["graphs_compiled"] > 0
    assert warm["graphs_compiled"] == 0 and warm["graphs_from_cache"] == cold["graphs_compiled"]
    assert "graphs_compiled" not in results["ray_train"][0]  # eager
    for key in ("ours_over_bare", "compiled_ours_over_bare_eager", "compiled_ours_over_bare_compiled"):
        assert set(results[key]) == {"1"} and summary[key] == results[key]
    assert set(results["first_step_seconds"]["1"]) == {
        "torchrun_eager", "ray_train_eager", "torchrun_compiled", "ray_train_compiled", "ray_train_warm_compiled"
    }  # fmt: skip
    assert results["ours_over_bare_by_round"] == {"1": [pytest.approx(results["ours_over_bare"]["1"])]}  # 1 round
    assert results["settings"]["rounds"] == 1
    assert results["one_process"]["device"] == "cpu" and results["settings"]["use_gpu"] is False
    assert results["data_parallel"] is None
    assert results["skipped"] == [
        {
            "variant": "data_parallel",
            "reason": "nn.DataParallel runs on CUDA GPUs; this run is on CPUs (--no-use-gpu or no GPU for each worker)",
        }
    ]
    assert_figures_positive({k: v for k, v in results.items() if k != "data_parallel"})


@pytest.mark.slow
def test_bench_data_smoke(tmp_path):
    out = tmp_path / "data"
    summary = run_cli_json("bench", "data", "--out", str(out), "--num-images", "32", "--loader-batch-size", "8",
                           "--loader-workers", "1,2", "--repeats", "1")  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert [Path(p).name for p in summary["plots"]] == [
        f"{case}_per_process.png" for case in ("raw_32", "raw_224", "encoded_jpeg_224")
    ]
    assert all(Path(p).stat().st_size > 0 for p in summary["plots"])
    assert_machine(results)
    cases = results["cases"]
    assert set(cases["raw_224"]["loaders"]) == {
        "ours_uint8",
        "ours_plus_cpu_transform",
        "per_sample_float_before",
        "torchvision_imagefolder_pil",
    }
    assert set(cases["encoded_jpeg_224"]["loaders"]) == {"ours_uint8", "torchvision_imagefolder_pil"}
    assert cases["raw_224"]["stored_bytes_per_image"] == 224 * 224 * 3
    assert cases["encoded_jpeg_224"]["stored_bytes_per_image"] < 224 * 224 * 3 and cases["encoded_jpeg_224"]["encoded"]
    for case in cases.values():
        for by_workers in case["loaders"].values():
            assert set(by_workers) == {"1", "2"}
            for figure in by_workers.values():
                assert_spread(figure["samples_per_second"])
                assert_spread(figure["samples_per_cpu_second"])
            two = by_workers["2"]
            assert two["per_process"]["median"] == pytest.approx(two["samples_per_second"]["median"] / 2)
    assert set(results["ratios"]) == {"per_process", "samples_per_cpu_second"}
    assert set(results["ratios"]["per_process"]["encoded_224_ours_over_torchvision"]) == {"1", "2"}
    assert summary["ratios"] == results["ratios"]
    assert_figures_positive(results)


@pytest.mark.slow
def test_bench_data_with_an_auto_augment_policy(tmp_path):
    """Ours and torchvision's loaders both run the policy; the per-sample float path, which has none,
    is left out, and so is its ratio."""
    out = tmp_path / "data"
    summary = run_cli_json("bench", "data", "--out", str(out), "--cases", "raw_32,encoded_jpeg_224",
                           "--num-images", "32", "--loader-batch-size", "8", "--loader-workers", "1", "--repeats", "1",
                           "--auto-augment", "ta_wide")  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["auto_augment"] == "ta_wide"
    assert set(results["cases"]["raw_32"]["loaders"]) == {
        "ours_uint8",
        "ours_plus_cpu_transform",
        "torchvision_imagefolder_pil",
    }
    assert set(results["cases"]["encoded_jpeg_224"]["loaders"]) == {"ours_uint8", "torchvision_imagefolder_pil"}
    assert summary["ratios"] == results["ratios"]
    assert set(results["ratios"]["per_process"]) == {"encoded_224_ours_over_torchvision"}
    for case in results["cases"].values():
        for by_workers in case["loaders"].values():
            assert_spread(by_workers["1"]["samples_per_second"])


@pytest.mark.slow
def test_bench_data_pipeline_input_smoke(ray_session, tmp_path):
    """The pipeline run loop fed by the driver (before) and by stage 0's loader (after), on the
    session's Ray: same steps, same samples (equal losses), every figure and ratio there."""
    out = tmp_path / "pipeline_input"
    summary = run_cli_json("bench", "data", "--out", str(out), "--cases", "pipeline_input_jpeg_224",
                           "--num-images", "24", "--pipeline-steps", "2", "--pipeline-warmup", "1",
                           "--pipeline-batch-size", "8", "--repeats", "1")  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    name = "pipeline_input_jpeg_224"
    assert [Path(p).name for p in summary["plots"]] == [
        f"{name}_samples_per_second.png",
        f"{name}_driver_cpu_per_sample.png",
    ]
    assert all(Path(p).stat().st_size > 0 for p in summary["plots"])
    assert_machine(results)
    assert list(results["cases"]) == [name] and results["ratios"] == {"per_process": {}, "samples_per_cpu_second": {}}
    case = results["cases"][name]
    assert (case["image_size"], case["encoded"], case["batch_size"], case["microbatches"], case["loader_workers"]) == (
        224,
        True,
        8,
        4,
        1,
    )
    assert case["images"] == 24 and case["train_images"] == 23
    before, after = case["runs"]["driver_reads"], case["runs"]["stage_loaders"]
    for run in (before, after):
        assert (run["timed_steps"], run["timed_samples"], run["warmup_steps"]) == (2, 16, 1)
        for figure in ("samples_per_second", "driver_cpu_seconds_per_sample", "driver_cores_busy", "wall_seconds"):
            assert_spread(run[figure])
    assert after["stage_reads"] == [24, 24]  # (1 + 2) steps of 8: the images on stage 0, the labels on stage 1
    assert case["same_samples"]["steps_compared"] == 3 and case["same_samples"]["max_loss_difference"] < 1e-5
    ratios = case["after_over_before"]
    assert set(ratios) >= {"samples_per_second", "driver_cpu_seconds_per_sample"}
    for figure, ratio in ratios.items():
        assert ratio == pytest.approx(after[figure]["median"] / before[figure]["median"])
    assert set(case["acceptance"]) == {"driver_cpu_per_sample_under_5_percent", "samples_per_second_not_lower"}
    assert summary["pipeline_input_after_over_before"] == ratios
    assert_figures_positive(results)


def test_pipeline_input_case_makes_an_epoch_per_pass():
    from raytrain_mp.bench.config import BenchDataConfig
    from raytrain_mp.bench.data_pipeline import pipeline_image_count

    def train(count: int) -> int:
        return count - int(round(count * 0.05))  # prepare's split, val_fraction 0.05

    tiny = BenchDataConfig(out="o", num_images=24, pipeline_steps=2, pipeline_warmup=1, pipeline_batch_size=8)
    assert pipeline_image_count(tiny) == 24  # 23 train images hold a pass of 16
    assert pipeline_image_count(dataclasses.replace(tiny, pipeline_warmup=3)) == 25  # the warm-up's 24 need 25
    count = pipeline_image_count(BenchDataConfig(out="o", num_images=512, pipeline_steps=30, pipeline_batch_size=32))
    assert train(count) >= 30 * 32 > train(count - 1)


def test_bench_bad_input(capsys, tmp_path):
    out = str(tmp_path / "x")
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--split-points", "layer2,layer3"), "--split-points"
    )
    assert_usage_error(run_cli(capsys, "bench", "pipeline", "--out", out, "--microbatches", "1,65"), "--microbatches")
    assert_usage_error(run_cli(capsys, "bench", "pipeline", "--out", out, "--stages", "1"), "--stages")
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--overhead-microbatches", "0,2"), "--overhead-microbatches"
    )
    assert_usage_error(
        run_cli(
            capsys, "bench", "pipeline", "--out", out, "--overhead-batch-size", "8", "--overhead-microbatches", "4,16"
        ),
        "--overhead-microbatches",
        "between 1 and --overhead-batch-size 8",
        "[16]",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--overhead-batch-size", "0"), "--overhead-batch-size"
    )
    assert_usage_error(run_cli(capsys, "bench", "pipeline", "--out", out, "--overhead-steps", "0"), "--overhead-steps")
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--overhead-rounds", "0"),
        "--overhead-rounds: must be >= 1, got 0",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--resnet-rounds", "0"),
        "--resnet-rounds: must be >= 1, got 0",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--balance-trials", "-1"),
        "--balance-trials: must be >= 0, got -1",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--memory-format", "nhwc"), "--memory-format", "'nhwc'"
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--balance-microbatches", "3"),
        "--balance-microbatches: must divide --global-batch-size 64 for --balance-trials' steps, got 3",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--overhead-schedules", "gpipe,zigzag"),
        "--overhead-schedules",
        "zigzag",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--hybrid-workers", "0"), "--hybrid-workers: must be >= 1"
    )
    assert_usage_error(
        run_cli(capsys, "bench", "pipeline", "--out", out, "--hybrid-workers", "4", "--hybrid-microbatches", "6"),
        "--hybrid-microbatches: must be a multiple of --hybrid-workers 4 that divides --global-batch-size 64, got 6",
    )
    assert_usage_error(run_cli(capsys, "bench", "ddp", "--out", out, "--num-workers", "0"), "--num-workers")
    assert_usage_error(run_cli(capsys, "bench", "ddp", "--out", out, "--steps", "0"), "--steps")
    assert_usage_error(run_cli(capsys, "bench", "ddp", "--out", out, "--rounds", "0"), "--rounds: must be >= 1, got 0")
    assert_usage_error(run_cli(capsys, "bench", "ddp"), "--out")
    assert_usage_error(
        run_cli(capsys, "bench", "data", "--out", out, "--loader-workers", "0,1"),
        "--loader-workers: each count must be >= 1",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "data", "--out", out, "--num-images", "40"),
        "--num-images: must be at least twice --loader-batch-size 32",
    )
    assert_usage_error(run_cli(capsys, "bench", "data", "--out", out, "--repeats", "0"), "--repeats: must be >= 1")
    assert_usage_error(
        run_cli(capsys, "bench", "data", "--out", out, "--auto-augment", "rand"),
        "argument --auto-augment: invalid choice: 'rand' (choose from 'ra', 'ta_wide', 'augmix', 'imagenet',",
    )
    assert_usage_error(
        run_cli(capsys, "bench", "data", "--out", out, "--cases", "raw_32,jpeg"), "--cases: unknown case(s) ['jpeg']"
    )
    assert_usage_error(
        run_cli(
            capsys, "bench", "data", "--out", out, "--cases", "pipeline_input_jpeg_224", "--pipeline-batch-size", "6"
        ),
        "--pipeline-batch-size: must be a positive multiple of --pipeline-microbatches 4, got 6",
    )


def test_bench_refuses_gpus_that_are_not_there(capsys, tmp_path):
    """Decided on this machine's CUDA devices, before anything runs: more stages than GPUs, and
    (where there is none) any GPU at all."""
    import torch

    gpus = torch.cuda.device_count()
    stages = str(max(2, gpus + 1))
    res = run_cli(capsys, "bench", "pipeline", "--use-gpu", "--stages", stages,
                  "--split-points", ",".join(["layer3"] * (int(stages) - 1)),
                  "--out", str(tmp_path / "p"))  # fmt: skip
    assert_usage_error(
        res,
        f"--use-gpu: {stages} stages need {stages} GPUs (one each: NCCL ranks cannot share a GPU) and this machine "
        f"has {gpus}",
    )
    if gpus == 0:
        res = run_cli(capsys, "bench", "ddp", "--use-gpu", "--out", str(tmp_path / "d"))
        assert_usage_error(res, "--use-gpu: this machine has no CUDA GPU", "accepted: --no-use-gpu")
    assert not (tmp_path / "p").exists() and not (tmp_path / "d").exists()


def test_hybrid_layouts_cover_every_factoring_of_the_workers():
    from raytrain_mp.bench.pipeline.hybrid import hybrid_layouts

    assert hybrid_layouts(2) == [(2, 1), (1, 2)]  # pure data parallel, pure pipeline
    assert hybrid_layouts(4) == [(4, 1), (2, 2), (1, 4)]
    assert hybrid_layouts(1) == [(1, 1)]


def test_rounds_pool_each_points_samples_and_keep_the_rounds_medians():
    from raytrain_mp.bench.common import pooled

    def run(m: int, steps: list[float], extra: dict) -> dict:
        return {
            "schedule": "gpipe",
            "microbatches": m,
            "step_seconds": {"median": sorted(steps)[len(steps) // 2]},
            "samples": {"step_seconds": steps},
            **extra,
        }

    first = [run(2, [3.0, 1.0, 2.0], {"bubble_formula": 1 / 3, "busy_seconds": [1.0]}), run(4, [5.0], {})]
    second = [run(2, [9.0, 8.0, 7.0], {"bubble_formula": 1 / 3, "busy_seconds": [2.0]}), run(4, [6.0], {})]
    assert pooled([first, second]) == [
        {"schedule": "gpipe", "microbatches": 2, "bubble_formula": 1 / 3,
         "busy_seconds": [1.0],  # measured once: the first round's
         "step_seconds": {"median": 5.0, "min": 1.0, "max": 9.0},
         "samples": {"step_seconds": [3.0, 1.0, 2.0, 9.0, 8.0, 7.0]},
         "round_medians": {"step_seconds": [2.0, 8.0]}},
        {"schedule": "gpipe", "microbatches": 4, "step_seconds": {"median": 5.5, "min": 5.0, "max": 6.0},
         "samples": {"step_seconds": [5.0, 6.0]}, "round_medians": {"step_seconds": [5.0, 6.0]}},
    ]  # fmt: skip
    with pytest.raises(ValueError):  # rounds that ran different points cannot be pooled
        pooled([first, second[:1]])


def test_bench_ddp_pools_its_rounds_and_says_the_ratio_of_each():
    """Two rounds of the DDP step on each side, 2 workers of 4 samples: the sides' steps pooled, and
    ours over torchrun pooled (the medians' ratio) and round by round."""
    from raytrain_mp.bench.common import pooled
    from raytrain_mp.bench.ddp import over, throughput

    def runs(*steps: list[float]) -> list[dict]:
        return [{"workers": 2, **throughput({"step_seconds": s, "first_step_seconds": 9.0}, 8)} for s in steps]

    bare = pooled([runs([1.0, 2.0, 3.0]), runs([4.0, 4.0, 4.0])])
    ours = pooled([runs([2.0, 2.0, 2.0]), runs([8.0, 4.0, 4.0])])
    # each step's samples/s pooled (8, 4, 8/3, then 2, 2, 2): the median of the even count is a mean of two
    assert bare[0]["samples_per_second"] == {"median": (2.0 + 8 / 3) / 2, "min": 2.0, "max": 8.0}
    assert bare[0]["round_medians"]["samples_per_second"] == [4.0, 2.0] and bare[0]["first_step_seconds"] == 9.0
    assert ours[0]["samples"]["step_seconds"] == [2.0, 2.0, 2.0, 8.0, 4.0, 4.0]
    assert over(ours, bare) == {"2": pytest.approx(3.0 / ((2.0 + 8 / 3) / 2))}  # ours: 4, 4, 4, 1, 2, 2
    assert over(ours, bare, by_round=True) == {"2": [1.0, 1.0]}
    assert over(ours, bare[:0]) == {}  # a worker count the peer skipped has no ratio


@pytest.mark.slow
def test_timeline_script_records_every_op_of_both_runtimes(tmp_path):
    """scripts/pipeline_timeline.py (the README's per-op account of ours against torch on the seeds'
    split): every recorded step holds each micro-batch's forward and backward once (and ours' second
    rank the weight part of its split last backward), one after the other inside the step; the
    summary counts the steps after warm-up and its ratios are those of the medians; the plot is
    written."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "pipeline_timeline.py"
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RANK")}
    rounds, steps, warmup, m = 1, 2, 1, 2
    done = subprocess.run(
        [sys.executable, str(script), "--model", "resnet18", "--image-size", "16", "--global-batch-size", "8",
         "--microbatches", str(m), "--rounds", str(rounds), "--steps", str(steps), "--warmup", str(warmup),
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    recorded = [
        json.loads(line) for path in (tmp_path / "spans").glob("*.jsonl") for line in path.read_text().splitlines()
    ]
    # ours: one step a call, then queued (bench.pipeline.timing.pipeline_run), each warm-up + steps;
    # torch: warm-up + steps
    per_rank = {"ours": rounds * 2 * (warmup + steps), "torch": rounds * (warmup + steps)}
    for runtime, count in per_rank.items():
        for schedule in ("gpipe", "1f1b"):
            for rank in (0, 1):
                mine = [r for r in recorded if (r["runtime"], r["schedule"], r["rank"]) == (runtime, schedule, rank)]
                assert len(mine) == count
                for step in mine:
                    ops = sorted(step["ops"], key=lambda op: op[3])
                    # ours splits the last backward of every stage but the first (stage.split_last_backward)
                    split = [("W", m - 1)] if (runtime, rank) == ("ours", 1) else []
                    assert (
                        sorted((kind, chunk) for kind, _, chunk, _, _ in ops)
                        == [("B", i) for i in range(m)] + [("F", i) for i in range(m)] + split
                    )
                    assert {stage for _, stage, _, _, _ in ops} == {rank}
                    assert 0 <= ops[0][3] and ops[-1][4] <= step["wall"]
                    assert all(earlier[4] <= later[3] for earlier, later in zip(ops, ops[1:]))
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert [(p["schedule"], p["microbatches"]) for p in timeline["points"]] == [("1f1b", m), ("gpipe", m)]
    for point in timeline["points"]:
        ranks = point["ranks"]
        # a round's first warm-up steps of each runtime are left out (ours' queued steps follow warm ones)
        assert {runtime: [r["steps"] for r in rs] for runtime, rs in ranks.items()} == {
            runtime: [count - rounds * warmup] * 2 for runtime, count in per_rank.items()
        }
        for ratio, ours, torch_ in zip(point["torch_over_ours"], ranks["ours"], ranks["torch"], strict=True):
            assert all(
                math.isclose(ratio[f], torch_[f] / ours[f])
                for f in ("wall", "forward", "backward", "idle", "forward_op", "backward_op")
            )
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_step_split_script_times_both_loops_in_both_places():
    """scripts/pipeline_step_split.py (the README's account of the overhead gap): each loop timed
    once per round under torchrun and in Ray actors, and the ratios are those of the medians."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "pipeline_step_split.py"
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RANK")}
    done = subprocess.run(
        [sys.executable, str(script), "--schedule", "1f1b", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    split = json.loads(done.stdout)
    assert (split["schedule"], split["microbatches"], split["rounds"]) == ("1f1b", 8, 2)
    ms = split["ms_per_step"]
    assert set(ms) == {"torchrun", "ray_actors"} and all(set(loops) == {"ours", "torch"} for loops in ms.values())
    for loops in ms.values():
        for figure in loops.values():
            assert_spread(figure)
            assert figure["min"] > 0
    for place, ratio in split["torch_over_ours_same_process"].items():
        assert math.isclose(ratio, ms[place]["torch"]["median"] / ms[place]["ours"]["median"])
    for loop, ratio in split["torchrun_over_ray_actors_same_code"].items():
        assert math.isclose(ratio, ms["torchrun"][loop]["median"] / ms["ray_actors"][loop]["median"])
