"""One vocabulary across the command line: every flag of every subcommand, one name per concept,
the same default for the same training option, retired spellings that still work for a release,
and a ``--help`` that imports neither torch nor Ray (what keeps it fast)."""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys

import pytest

from raytrain_mp.cli import build_parser

# A concept, recognised by the start of its help text, and the one flag that carries it.
CONCEPTS = {
    r"samples per (optimizer|training) step": "--global-batch-size",
    r"(Ray Train workers|worker counts)": "--num-workers",
    r"CPUs per worker": "--cpus-per-worker",
    r"CPUs per stage": "--cpus-per-stage",
    r"weight decay": "--weight-decay",
    r"learning rate at --base-batch": "--base-lr",
    r"Ray cluster address": "--address",
    r"run name": "--name",
    r"pipeline stages": "--stages",
    r"micro-batch(es| counts)": "--microbatches",
    r"also show Ray's informational log lines": "--verbose",
}
TRAINING_COMMANDS = ("ddp", "pipeline", "tune")
# Same name, deliberately different default: DDP workers fill nodes, pipeline stages share one; a
# DDP worker's loader processes come out of --cpus-per-worker (None: all of them but one), a
# pipeline stage's on top of --cpus-per-stage, its torch threads (0: none). A DDP model computes
# contiguous, as the torchrun script a user compares it with, unless asked to time the layouts
# (auto: a choice by timing, so runs of different worker counts could differ by rounding); a
# pipeline stage, which no single script runs, is timed.
DIFFERENT_DEFAULTS = {"placement", "loader_workers", "memory_format"}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every leaf subcommand's parser, by its words ("bench ddp")."""
    found = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[" ".join(words)] = parser
        for action in subs:
            for name, child in action.choices.items():
                walk(child, (*words, name))

    walk(build_parser(), ())
    return found


def visible_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        action.option_strings[0]: action
        for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS and action.option_strings[0] != "-h"
    }


def test_every_subcommand_is_listed():
    assert sorted(subcommands()) == [
        "bench data",
        "bench ddp",
        "bench pipeline",
        "data prepare",
        "ddp",
        "eval",
        "export",
        "pipeline",
        "predict",
        "tune",
    ]


@pytest.mark.parametrize("pattern, flag", CONCEPTS.items())
def test_one_concept_one_flag(pattern, flag):
    carriers = {
        (command, name)
        for command, parser in subcommands().items()
        for name, action in visible_flags(parser).items()
        if re.match(pattern, action.help or "")
    }
    assert {name for _, name in carriers} == {flag}, carriers
    assert len({command for command, _ in carriers}) >= 2, carriers  # a concept shared, or the check is idle


def test_a_training_option_has_one_default_everywhere():
    from raytrain_mp.ddp.config import DDPConfig
    from raytrain_mp.pipeline.config import PipelineConfig
    from raytrain_mp.tune.config import TuneConfig

    classes = {"ddp": DDPConfig, "pipeline": PipelineConfig, "tune": TuneConfig}
    defaults: dict[str, dict[str, object]] = {}
    for command, cls in classes.items():
        for field in cls.__dataclass_fields__.values():
            defaults.setdefault(field.name, {})[command] = field.default
    differing = {name: by for name, by in defaults.items() if len(set(map(repr, by.values()))) > 1}
    assert set(differing) == DIFFERENT_DEFAULTS, differing


def test_pipeline_trainer_defaults_match_the_command_line():
    from raytrain_mp.pipeline.config import PipelineConfig
    from raytrain_mp.pipeline.trainer import PipelineTrainer

    signature = inspect.signature(PipelineTrainer)
    for argument, option in [
        ("weight_decay", "weight_decay"),
        ("momentum", "momentum"),
        ("schedule", "schedule"),
        ("num_microbatches", "microbatches"),
        ("cpus_per_stage", "cpus_per_stage"),
        ("placement_strategy", "placement"),
    ]:
        assert signature.parameters[argument].default == PipelineConfig.__dataclass_fields__[option].default, argument


@pytest.mark.parametrize(
    "argv, dest, old, new",
    [
        (["pipeline", "--batch-size", "32"], "global_batch_size", "--batch-size", "--global-batch-size"),
        (
            ["bench", "pipeline", "--out", "o", "--batch-size", "8"],
            "global_batch_size",
            "--batch-size",
            "--global-batch-size",
        ),
        (
            ["bench", "ddp", "--out", "o", "--batch-size", "4"],
            "batch_size_per_worker",
            "--batch-size",
            "--batch-size-per-worker",
        ),
        (["bench", "ddp", "--out", "o", "--workers", "1,2"], "num_workers", "--workers", "--num-workers"),
        (["bench", "ddp", "--out", "o", "--threads", "2"], "cpus_per_worker", "--threads", "--cpus-per-worker"),
    ],
)
def test_retired_spellings_work_for_a_release_with_one_warning(capsys, argv, dest, old, new):
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == argv[-1]
    assert capsys.readouterr().err == f"raytrain-mp: warning: {old} is deprecated and will be removed; use {new}\n"
    assert old not in visible_flags(subcommands()[" ".join(w for w in argv[:2] if not w.startswith("-"))])


@pytest.mark.parametrize("argv", [["tune", "--label-smoothing", "0.1"], ["ddp", "--epoch", "1"]])
def test_a_flag_is_its_whole_name(capsys, tmp_path, argv):
    """argparse would take a prefix of one flag for it: tune's --label-smoothing for the grid
    --label-smoothings, which is not what the user wrote."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"raytrain-mp: error: unrecognized arguments: {' '.join(argv[1:])}"
    ]


def test_retired_yaml_keys_work_with_one_warning(tmp_path, capsys):
    from raytrain_mp.config import build_config
    from raytrain_mp.pipeline.config import PipelineConfig

    path = tmp_path / "old.yaml"
    path.write_text("batch_size: 32\nmicrobatches: 2\n")
    cfg = build_config(PipelineConfig, {"config": str(path)})
    assert (cfg.global_batch_size, cfg.microbatches) == (32, 2)
    assert capsys.readouterr().err == (
        f"raytrain-mp: warning: 'batch_size' in {path} is deprecated and will be removed; use 'global_batch_size'\n"
    )


def test_help_groups_options_and_writes_defaults_as_typed():
    text = subprocess.run(["raytrain-mp", "bench", "ddp", "--help"], capture_output=True, text=True, check=True).stdout
    for group in (
        "model options:",
        "optimization options:",
        "distribution options:",
        "benchmark options:",
        "output options:",
    ):
        assert group in text
    flat = " ".join(text.split())
    assert (
        "(default: 1,2)" in flat
        and "(default: --no-sync-bn)" in flat
        and "--out OUT folder for results.json and the plot (required)" in flat
    )
    assert "(1, 2)" not in flat and "(default: False)" not in flat and "(default: )" not in flat


def test_help_imports_neither_torch_nor_ray():
    code = (
        "import sys, contextlib, io\nfrom raytrain_mp.cli import main\n"
        "for argv in (['ddp', '--help'], ['pipeline', '--help'], ['tune', '--help'], ['bench', 'pipeline', '--help'],"
        " ['eval', '--help'], ['predict', '--help'], ['export', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n            main(argv)\n        except SystemExit:\n            pass\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'ray', 'pyarrow') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
