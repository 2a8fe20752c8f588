"""The ``raytrain-mp`` command line: parse, validate into a config dataclass, then run.

Invariants: every bad input ends as one line ``raytrain-mp: error: ...`` on stderr and exit code 2
(argparse's own errors included), raised before Ray starts or any output is written, and an
option's own errors (``build_config``) before a command imports its capability, torch or Ray, so
they are said at once; a run that
fails for good (its restarts used up) ends as one line ``raytrain-mp: failed: ...`` and exit code 1; Ctrl-C,
SIGTERM or SIGHUP ends a command with one line on stderr and exit code 130, 143 or 129 (``interruption``); with
``--json`` the last line of stdout is one JSON object describing the result, at full precision;
without it the result prints as ``key: value`` lines whose floats have 4 significant digits
(``readable``, the format of the epoch lines too).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from raytrain_mp.bench.config import BenchDataConfig, BenchDDPConfig, BenchPipelineConfig
from raytrain_mp.config import add_arguments, build_config
from raytrain_mp.data.config import PrepareConfig
from raytrain_mp.ddp.config import DDPConfig
from raytrain_mp.errors import EXIT_FAILED, EXIT_USAGE, RunFailedError, UsageError
from raytrain_mp.inference.config import EvalConfig, ExportConfig, PredictConfig
from raytrain_mp.interruption import Interrupted, carried_signal, signals_interrupt
from raytrain_mp.pipeline.config import PipelineConfig
from raytrain_mp.readable import readable
from raytrain_mp.tune.config import TuneConfig

PROG = "raytrain-mp"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the message) rather than the usage block, and a
    flag is only its whole name: argparse's default takes a prefix for the one flag it begins, so
    ``tune --label-smoothing 0.1`` would silently set the grid ``--label-smoothings``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401 - argparse's signature
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def emit(result: dict, as_json: bool, title: str, brief: Callable[[dict], dict] | None = None) -> None:
    """The result: one JSON line at full precision with ``--json``, else the title and one
    ``key: value`` line each, floats as a person reads them; ``brief`` shortens the result for
    that (the pipeline's stages: a line each)."""
    if as_json:
        print(json.dumps(result, default=str))
        return
    print(title)
    for key, value in (brief(result) if brief else result).items():
        print(f"  {key}: {readable(value)}")


def cmd_prepare(args: argparse.Namespace) -> int:
    cfg = build_config(PrepareConfig, args)
    from raytrain_mp.data.prepare import prepare

    meta = prepare(
        cfg.source,
        cfg.out,
        rows_per_shard=cfg.rows_per_shard,
        overwrite=cfg.overwrite,
        val_fraction=cfg.val_fraction,
        seed=cfg.seed,
        num_samples=cfg.num_samples,
        image_size=cfg.image_size,
        num_classes=cfg.num_classes,
        channels=cfg.channels,
        encoded=cfg.encoded,
    )
    result = {
        "out": cfg.out,
        "source": meta.source,
        "train": meta.counts["train"],
        "val": meta.counts["val"],
        **{f"{split}_per_class": dict(zip(meta.class_names, meta.class_counts[split])) for split in ("train", "val")},
        "image_shape": list(meta.image_shape),
        "num_classes": meta.num_classes,
        "encoded": meta.encoded,
    }
    emit(result, args.json, f"prepared {cfg.source} into {cfg.out}")
    return 0


def run_on_ray(cfg, run, as_json: bool, title: str, quiet: bool = False, brief=None) -> dict:
    """Join (or start) Ray for ``cfg.address``, run, and print the result; Ray starts only now,
    after the config and its data passed every check."""
    from raytrain_mp.cluster import ray_connection

    with ray_connection(cfg.address, cfg.verbose, quiet):
        result = run(cfg)
    emit(result, as_json, title, brief)
    return result


def finished_already(cfg, command: str, as_json: bool, brief=None) -> bool:
    """A rerun of a finished run (same ``--storage-path`` and ``--name``, no more ``--epochs``)
    prints that run's summary and starts nothing; more epochs continue it."""
    from raytrain_mp.api import finished_run

    result = finished_run(cfg)
    if result is not None:
        emit(
            result,
            as_json,
            f"{command} run {cfg.name} already finished {result['epochs']} epochs (raise --epochs to continue it)",
            brief,
        )
    return result is not None


def cmd_ddp(args: argparse.Namespace) -> int:
    cfg = build_config(DDPConfig, args)
    from raytrain_mp.ddp.trainer import run_ddp, with_checked_data

    cfg = with_checked_data(cfg)
    if not finished_already(cfg, "ddp", args.json):
        run_on_ray(cfg, run_ddp, args.json, "ddp training finished", cfg.quiet)
    return 0


def cmd_pipeline(args: argparse.Namespace) -> int:
    cfg = build_config(PipelineConfig, args)
    from raytrain_mp.pipeline.run import run_pipeline, with_checked_inputs
    from raytrain_mp.pipeline.summary import text_summary

    cfg = with_checked_inputs(cfg)
    if not finished_already(cfg, "pipeline", args.json, text_summary):
        run_on_ray(cfg, run_pipeline, args.json, "pipeline training finished", cfg.quiet, text_summary)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from raytrain_mp.tune.config import tune_config_from_args

    cfg = tune_config_from_args(args)
    from raytrain_mp.tune.sweep import prepared, run_sweep

    result = run_on_ray(prepared(cfg), run_sweep, args.json, "learning-rate sweep finished")
    return (
        0 if result["best"] else 1
    )  # every trial failed, or the sweep was interrupted (its "resume" says how to go on)


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = build_config(EvalConfig, args)
    from raytrain_mp.inference.evaluation import run_eval, with_checked_inputs

    cfg = with_checked_inputs(cfg)
    run_on_ray(cfg, run_eval, args.json, f"evaluation written to {cfg.out}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    cfg = build_config(PredictConfig, args)
    from raytrain_mp.inference.predict import print_predictions, run_predict, with_checked_inputs

    cfg, inputs = with_checked_inputs(cfg)
    result = run_predict(cfg, inputs)
    print_predictions(result, args.json)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    cfg = build_config(ExportConfig, args)
    from raytrain_mp.inference.export import ExportMismatch, run_export

    try:
        result = run_export(cfg)
    except ExportMismatch as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    emit(
        result,
        args.json,
        f"{cfg.format} export written to {result['out']} (largest difference from the PyTorch model: "
        f"{result['max_abs_difference']:.3g})",
    )
    return 0


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    cfg = build_config(BenchPipelineConfig, args)
    from raytrain_mp.bench.pipeline import run_bench_pipeline

    run_on_ray(cfg, run_bench_pipeline, args.json, f"pipeline benchmark written to {cfg.out}")
    return 0


def cmd_bench_ddp(args: argparse.Namespace) -> int:
    cfg = build_config(BenchDDPConfig, args)
    from raytrain_mp.bench.ddp import run_bench_ddp

    result = run_bench_ddp(cfg)  # starts Ray itself, after the torchrun runs
    emit(result, args.json, f"ddp benchmark written to {cfg.out}")
    return 0


def cmd_bench_data(args: argparse.Namespace) -> int:
    cfg = build_config(BenchDataConfig, args)
    from raytrain_mp.bench.data import run_bench_data

    emit(run_bench_data(cfg), args.json, f"data benchmark written to {cfg.out}")
    return 0


def docs(page: str) -> str:
    """The last line of a ``--help``: the page of the repository that covers the command."""
    return f"docs: {page}"


def add_command(
    sub, name: str, help_text: str, config_cls: type, handler, page: str, positional: tuple[str, ...] = ()
) -> argparse.ArgumentParser:
    """A subcommand whose flags are ``config_cls``'s fields (but ``positional``), whose work is
    ``handler`` and whose ``--help`` ends with the docs ``page`` that covers it."""
    parser = sub.add_parser(name, help=help_text, epilog=docs(page))
    add_arguments(parser, config_cls, positional=positional)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Distributed training of vision models on Ray: DDP, pipelined model parallelism, lr sweeps.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=docs("README.md; every option of every command: docs/cli.md"),
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    data = sub.add_parser("data", help="prepare data sets as Parquet shards", epilog=docs("docs/data.md"))
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=OneLineParser)
    prep = add_command(
        data_sub,
        "prepare",
        "write SOURCE as Parquet shards + metadata into --out",
        PrepareConfig,
        cmd_prepare,
        "docs/data.md",
        ("source",),
    )
    prep.add_argument("source", metavar="SOURCE", help="digits | synthetic | cifar10:PATH | imagefolder:PATH")
    add_command(sub, "ddp", "DistributedDataParallel training on Ray Train", DDPConfig, cmd_ddp, "docs/ddp.md")
    add_command(
        sub,
        "pipeline",
        "pipelined model-parallel training on Ray stage actors",
        PipelineConfig,
        cmd_pipeline,
        "docs/pipeline.md",
    )
    add_command(
        sub, "tune", "learning-rate sweep on Ray Tune, one DDP run per trial", TuneConfig, cmd_tune, "docs/tune.md"
    )
    add_command(
        sub,
        "eval",
        "exact evaluation of a checkpoint on Ray Train workers: accuracy, loss, per class, confusion matrix",
        EvalConfig,
        cmd_eval,
        "docs/inference.md",
    )
    predict = add_command(
        sub,
        "predict",
        "top-k classes of image files, preprocessed as the run's validation split",
        PredictConfig,
        cmd_predict,
        "docs/inference.md",
        ("files",),
    )
    predict.add_argument(
        "files",
        metavar="FILE_OR_FOLDER",
        nargs="+",
        help="image files (JPEG, PNG, any mode PIL reads) or folders of them",
    )
    add_command(
        sub,
        "export",
        "a checkpoint's model as ONNX, torch.export (.pt2) or TorchScript, checked before it is written",
        ExportConfig,
        cmd_export,
        "docs/inference.md",
    )

    bench = sub.add_parser(
        "bench", help="side-by-side benchmarks: results.json and PNG plots", epilog=docs("docs/performance.md")
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=OneLineParser)
    add_command(
        bench_sub,
        "pipeline",
        "one process vs model parallel vs pipelined schedules",
        BenchPipelineConfig,
        cmd_bench_pipeline,
        "docs/performance.md",
    )
    add_command(
        bench_sub,
        "ddp",
        "Ray Train DDP vs a bare torchrun loop, samples/s",
        BenchDDPConfig,
        cmd_bench_ddp,
        "docs/performance.md",
    )
    add_command(
        bench_sub,
        "data",
        "loader samples/s: raw and encoded images vs torchvision ImageFolder + PIL; with --cases "
        "pipeline_input_jpeg_224, the pipeline run loop fed by the driver vs by its stage loaders",
        BenchDataConfig,
        cmd_bench_data,
        "docs/performance.md",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = args.handler
    del args.handler
    for key in ("command", "data_command"):
        vars(args).pop(key, None)
    try:
        with signals_interrupt():
            return handler(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailedError as exc:
        print(f"{PROG}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (Interrupted, SystemError) as exc:  # the command has unwound: its workers and a Ray it started are stopped
        from raytrain_mp.checkpointing import interrupted_line

        interrupted = carried_signal(exc)
        if interrupted is None:
            raise
        print(f"{PROG}: {interrupted_line(interrupted)}", file=sys.stderr, flush=True)
        return interrupted.exit_code


if __name__ == "__main__":
    sys.exit(main())
