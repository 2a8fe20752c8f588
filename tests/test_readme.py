"""Every command in README.md and docs/*.md, word for word, and every relative link in them.

Each runnable command runs as a user would type it: in a shell, in ``DOCS`` order (README.md, then
the docs pages in a fixed order, so that later commands find what earlier ones made), in one fresh
working folder, with HOME a temporary folder (so ``~``, ``~/ray_results`` and the default data
cache are private) and no RAY_ADDRESS (so each command starts its own local Ray, as on a fresh
machine). A command that appears on several pages runs once, where it first appears. A block
marked ``SCRIPT_MARK`` (the one-box ``ray start`` ... ``ray stop`` of docs/deploy.md) runs whole,
as one bash script, so its ``export`` and ``source`` carry over to the commands after them. The rest
are listed in ``NOT_HERE`` with the reason; a command in none of these fails the test.

``python tests/test_readme.py`` writes docs/cli.md anew from the parser (every command's ``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The pages whose commands run, in the order they run: each page's commands may use what the pages
# before it made (README's data/digits and lr-sweep; storage.md's bucket data set before its runs).
DOCS = [README] + [
    REPO / "docs" / f"{name}.md"
    for name in (
        "data",
        "models",
        "ddp",
        "pipeline",
        "tune",
        "recipes",
        "python",
        "inference",
        "runs",
        "tracking",
        "storage",
        "deploy",
        "gpus",
        "performance",
        "development",
        "cli",
    )
]
CLI_PAGE = REPO / "docs" / "cli.md"

GPU = "needs CUDA GPUs"
CLOUD = "needs a cloud account or remote machines"
AFTER = "tests/inference/test_after_training.py runs eval, predict and export on a ddp run's checkpoint"
NOT_HERE = {
    "pip install -e '.[test,export]' && pytest": "this is .ci/run itself",
    "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu && pip install -e .":
        "it downloads torch from PyTorch's index again; .ci/run installs the default wheels",
    'pytest -m "not slow"': "the test suite itself, less its slow tests",
    "raytrain-mp pipeline --use-gpu --stages 4 --balance time --data data/cifar10": GPU,
    "scripts/gpu_check.sh": GPU + "; tests/test_gpu_readiness.py runs it here, where it skips every GPU step",
    "ray start --head --num-gpus=4": GPU + " (Ray would advertise 4 GPUs that are not there)",
    "raytrain-mp ddp --address auto --num-workers 4 --use-gpu": GPU,
    "raytrain-mp pipeline --address auto --stages 4 --use-gpu": GPU,
    "ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/pipeline_resnet.py --stages 4 "
    "--use-gpu": GPU,
    "ray up cluster.yaml": CLOUD,
    "ray dashboard cluster.yaml &": CLOUD,
    "export RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265": CLOUD + " (it points at `ray dashboard`'s tunnel)",
    "ray job submit --working-dir . -- python jobs/ddp_resnet.py --num-workers 4 --use-gpu "
    "--storage-path s3://BUCKET/runs": CLOUD,
    "ray job submit --working-dir . -- python jobs/pipeline_resnet.py --stages 2 --use-gpu "
    "--storage-path /mnt/nfs/runs": CLOUD,
    "ray job logs JOB_ID ; ray job stop JOB_ID": CLOUD + "; tests/test_deploy.py reads `ray job logs` of a local head",
    "ray down cluster.yaml": CLOUD,
    "ray job submit --working-dir . -- python jobs/tune_lr.py --global-batch-sizes 256,512,1024 "
    "--base-lrs 0.025,0.05,0.1,0.2 --num-workers 4 --use-gpu --storage-path s3://BUCKET/sweeps": CLOUD,
    **{command: "the sweep of docs/tune.md's study: 5 to 17 minutes alone on 2 cores; its tables are in docs/sweep"
       for command in (
        "raytrain-mp tune --global-batch-sizes 32,64,128 --base-lrs 0.0125,0.025,0.05,0.1,0.2,0.4 --base-batch 32 "
        "--lr-rule linear --scheduler none --epochs 3 --num-workers 1 --name rule-linear",
        "raytrain-mp tune --global-batch-sizes 32,64,128 --base-lrs 0.003125,0.00625 --base-batch 32 --lr-rule linear "
        "--scheduler none --epochs 3 --num-workers 1 --name rule-linear-low",
        "raytrain-mp tune --global-batch-sizes 32,64,128 --base-lrs 0.0125,0.025,0.05,0.1,0.2,0.4 --base-batch 32 "
        "--lr-rule none --scheduler none --epochs 3 --num-workers 1 --name rule-none",
    )},
    "raytrain-mp bench pipeline --out bench-tiny --model resnet18 --image-size 16 --global-batch-size 8 "
    "--microbatches 1,2 --steps 1 --warmup 0 --threads 1 --resnet-rounds 2 --overhead-rounds 1 --overhead-steps 2 "
    "--overhead-microbatches 8,1 --overhead-schedules gpipe,1f1b,interleaved-1f1b":
        "tests/bench/test_bench.py::test_bench_pipeline_smoke runs it word for word (plus --no-use-gpu: CPU tests pin "
        "the CPU) and checks every figure of its results.json",
    "raytrain-mp bench pipeline --out docs/bench/pipeline":
        "26 minutes alone on 2 cores; its figures are committed in docs/bench",
    "raytrain-mp bench ddp --out docs/bench/ddp":
        "6.5 minutes alone on 2 cores; its figures are committed in docs/bench",
    "python scripts/soak.py --faults 10 --out soak":
        "4 to 6 minutes on 2 cores; tests/test_soak.py runs it with 2 faults per trainer, and docs/runs.md quotes its "
        "figures",
    "raytrain-mp bench data --out docs/bench/data": "minutes on 2 cores; its figures are committed in docs/bench",
    "raytrain-mp bench pipeline --out docs/bench/hybrid --model resnet18 --image-size 32 --global-batch-size 32 "
    "--microbatches 2 --steps 5 --warmup 1 --no-balanced --no-interleaved --no-overhead":
        "minutes on 2 cores; its figures are committed in docs/bench",
    "raytrain-mp bench ddp --out docs/bench/ddp_standard_stem --no-small-stem":
        "minutes on 2 cores; its figures are committed in docs/bench",
    "raytrain-mp bench ddp --out docs/bench/ddp_compile --compile --num-workers 2 --rounds 3 --steps 20 --warmup 5":
        "11.5 minutes alone on 2 cores (three cold compiles of ResNet-18, then 2 rounds more); its figures are "
        "committed in docs/bench",
    "raytrain-mp bench ddp --out docs/bench/ddp_compile_8x8 --compile --num-workers 2 --image-size 8":
        "minutes on 2 cores (three cold compiles of ResNet-18); its figures are committed in docs/bench",
    **{command: "4 minutes on 2 cores (compiling ResNet-18's stages on both sides); its figures are committed in "
       "docs/bench"
       for command in (
        "raytrain-mp bench pipeline --out docs/bench/pipeline_compile_eager --model resnet18 --imag"
        "e-size 32 --global-batch-size 32 --microbatches 2,4 --steps 3 --warmup 1 --resnet-rounds 1"
        " --no-overhead --no-hybrid --no-balanced --no-interleaved",
        "raytrain-mp bench pipeline --out docs/bench/pipeline_compile --model resnet18 --image-size"
        " 32 --global-batch-size 32 --microbatches 2,4 --steps 3 --warmup 1 --resnet-rounds 1 --no-"
        "overhead --no-hybrid --no-balanced --no-interleaved --compile",
    )},
    **{command: "compiles ResNet-18: a minute or more on 2 cores; tests/ddp/test_ddp_compile.py runs ddp, eval and "
       "predict --compile end to end on a small network"
       for command in (
        "raytrain-mp ddp --num-workers 2 --compile",
        "raytrain-mp ddp --num-workers 2 --compile --memory-format auto",
    )},
    "python scripts/pipeline_timeline.py --out docs/bench/pipeline-timeline":
        "minutes on 2 cores; its figures are committed in docs/bench, and tests/bench/test_bench.py runs the script "
        "at tiny settings",
    **{command: "minutes on 2 cores; tests/bench/test_bench.py runs the script" for command in (
        "python scripts/pipeline_step_split.py --schedule gpipe --rounds 4",
        "python scripts/pipeline_step_split.py --schedule 1f1b --rounds 6",
    )},
    "raytrain-mp ddp --model mobilenet_v3_small --data data/syn --epochs 1":
        "an epoch of MobileNetV3 on 4,096 images, minutes on 2 cores; tests/test_models.py runs each model of "
        "docs/models.md's table, tests/test_user_model.py trains a module:callable",
    **{command: "torchvision's ImageNet weights are downloaded (no network here); tests/test_finetune.py runs the "
       "same fine-tuning, eval and predict with a stand-in file in a private TORCH_HOME" for command in (
        "raytrain-mp ddp --model resnet18 --weights IMAGENET1K_V1 --freeze-backbone --data data/photos "
        "--global-batch-size 8 --epochs 1 --name finetune",
        "raytrain-mp predict --checkpoint ~/ray_results/finetune ~/photos/cat/0.jpg --top-k 2",
    )},
    "raytrain-mp ddp --config configs/resnet50-imagenet-v2.yaml --data YOUR_IMAGENET --num-workers 8":
        "ImageNet, 600 epochs of ResNet-50 on 8 GPUs; tests/ddp/test_ddp_config.py builds every configs/ file and "
        "checks the recipe's values",
    "python scripts/recipe_study.py --out docs/bench/recipe":
        "27 minutes on 2 cores, seven ddp runs of 30 epochs: a study, not a check (its figures: docs/bench/recipe)",
    "raytrain-mp tune --global-batch-sizes 32,64 --base-lrs 0.1,0.4 --epochs 1 --num-workers 1 --name lr-sweep":
        "docs/tune.md's 2x2 grid; the README's sweep of the same name runs the same command with one base lr (its "
        "trials run one at a time here, 45 s each), and tests/tune/test_tune_sweep.py runs a 2x2 grid",
    "raytrain-mp tune --resume ~/ray_results/lr-sweep":
        "it starts Ray and restores the sweep for half a minute; tests/tune/test_tune_s3.py resumes a finished sweep "
        "(it reports again: its trials, best.yaml) and tests/tune/test_tune_sweep.py finishes an interrupted one",
    # eval, predict and export start Ray or load torch for seconds to a minute each; the suite's time goes elsewhere.
    "raytrain-mp eval --checkpoint ~/ray_results/lr-sweep --json": AFTER,
    "raytrain-mp predict --checkpoint ~/ray_results/lr-sweep my_digits/ --top-k 3":
        "my_digits/ is the reader's own images; " + AFTER,
    "raytrain-mp export --checkpoint ~/ray_results/lr-sweep --format onnx --out model.onnx": AFTER,
    **{command: "an MLflow server and the extra of docs/tracking.md; tests/ddp/test_ddp_train.py (ddp and eval),"
       " tests/pipeline/test_pipeline_cli.py and tests/tune/test_tune_sweep.py run --mlflow against a real mlflow "
       "server on 127.0.0.1" for command in (
        "pip install -e '.[mlflow]'",
        "mlflow server --host 127.0.0.1 --port 5000 &",
        "export MLFLOW_TRACKING_URI=http://127.0.0.1:5000",
        "raytrain-mp ddp --mlflow --mlflow-experiment digits --name tracked",
        "raytrain-mp eval --checkpoint ~/ray_results/tracked --mlflow --mlflow-experiment digits",
        "raytrain-mp tune --global-batch-sizes 32,64 --base-lrs 0.4 --epochs 1 --num-workers 1 --mlflow "
        "--mlflow-experiment digits --name tracked-sweep",
    )},
}  # fmt: skip

FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)


def page_text(page: Path) -> str:
    """``page``'s text; none for a page of ``DOCS`` that is not there (the test of ``DOCS`` says so)."""
    return page.read_text() if page.is_file() else ""


def page_blocks(page: Path, language: str) -> list[str]:
    """The fenced blocks of ``language`` in ``page``, dedented to their fence."""
    blocks = []
    for indent, lang, body in FENCE.findall(page_text(page)):
        if lang == language:
            blocks.append("\n".join(line[len(indent) :] for line in body.splitlines()))
    return blocks


def doc_blocks(language: str) -> list[str]:
    """The fenced blocks of ``language`` of every page, in ``DOCS`` order."""
    return [block for page in DOCS for block in page_blocks(page, language)]


def block_commands(block: str) -> list[str]:
    """The commands of one bash block in order: continuations joined, comments dropped."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        command = re.sub(r"\s+#\s.*$", "", line).strip()
        if command:
            commands.append(re.sub(r"\s+", " ", command))
    return commands


def readme_commands() -> list[str]:
    """Every command of the bash blocks of README.md and docs/, in ``DOCS`` order, repeats included
    (tests/test_deploy.py reads the ``ray job submit`` ones)."""
    return [command for block in doc_blocks("bash") for command in block_commands(block)]


SCRIPT_MARK = "<!-- tests/test_readme.py runs this block as one bash script -->"


def doc_scripts() -> list[str]:
    """The bash blocks right after a ``SCRIPT_MARK`` line, each to run whole as one script."""
    pattern = rf"^{re.escape(SCRIPT_MARK)}\n```bash\n(.*?)^```"
    return [script for page in DOCS for script in re.findall(pattern, page_text(page), re.S | re.M)]


def test_every_command_is_run_here_or_excused():
    commands = readme_commands()
    scripted = {command for script in doc_scripts() for command in block_commands(script)}
    assert set(DOCS) == {README, *(REPO / "docs").glob("*.md")}, (
        "a page of docs/ is missing from DOCS, or DOCS names one that is not there"
    )
    assert not scripted & set(NOT_HERE), scripted & set(NOT_HERE)  # a script runs every line of it
    assert set(NOT_HERE) <= set(commands), set(NOT_HERE) - set(commands)  # no stale excuses
    assert commands[:2] == ["pip install -e . && raytrain-mp ddp", "pip install -e '.[test,export]' && pytest"]
    assert (
        "pip install -e '.[test,export]' && pytest\n" in (REPO / ".ci" / "run").read_text()
    )  # the README's test command is CI's
    assert len(set(commands) - set(NOT_HERE)) >= 12


SCRIPTED = {command for script in doc_scripts() for command in block_commands(script)}
# Each command once, where it first appears: a page that shows a command again shows what already ran.
RUN_HERE = [
    command for command in dict.fromkeys(readme_commands()) if command not in NOT_HERE and command not in SCRIPTED
]


def test_commands_run_after_what_they_use():
    """What ``DOCS`` order must keep: a data set before its use, a sweep before its resume."""

    def at(command: str) -> int:
        assert command in RUN_HERE, command
        return RUN_HERE.index(command)

    assert (
        RUN_HERE[0] == "pip install -e . && raytrain-mp ddp"
    )  # prepares digits into the default cache the others read
    digits = at("raytrain-mp data prepare digits --out data/digits")
    assert all(digits < i for i, command in enumerate(RUN_HERE) if "--data data/digits" in command)
    sweep = at("raytrain-mp tune --global-batch-sizes 32,64 --base-lrs 0.4 --epochs 1 --num-workers 1 --name lr-sweep")
    # its resume is excused (NOT_HERE): the pages still show it after the sweep
    commands = readme_commands()
    assert commands.index(RUN_HERE[sweep]) < commands.index("raytrain-mp tune --resume ~/ray_results/lr-sweep")
    bucket = [i for i, command in enumerate(RUN_HERE) if '"s3://' in command]
    assert len(bucket) == 3 and RUN_HERE[bucket[0]].startswith("raytrain-mp data prepare digits --out")
    assert "data: data/digits" in doc_blocks("yaml")[0]  # run.yaml, which `ddp --config run.yaml` reads


# A link: [text](target) or ![alt](target), or a reference definition [label]: target.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)


def prose(text: str) -> str:
    """``text`` without its fenced blocks and inline code, where a ``[x](y)`` is not a link."""
    text = re.sub(r"^( *)```.*?^\1```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The ``#anchor`` of each heading of ``page``, as GitHub makes them."""
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(
        r"^#{1,6}\s+(.*?)\s*#*\s*$", re.sub(r"^( *)```.*?^\1```", "", page.read_text(), flags=re.S | re.M), re.M
    ):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


def relative_links(page: Path) -> list[str]:
    links = [a or b for a, b in LINK.findall(prose(page.read_text()))]
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]  # http:, https:, mailto: are not files


def test_every_relative_link_points_at_a_file_that_exists():
    broken = []
    for page in DOCS:
        for link in relative_links(page):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(REPO)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.relative_to(REPO)}: {link} (no such heading in {target.name})")
    assert not broken, "\n".join(broken)


def test_the_readme_links_to_every_page_and_the_cluster_and_figures_in_one_click():
    links = set(relative_links(README))
    assert {f"docs/{page.name}" for page in DOCS[1:]} <= links, {f"docs/{page.name}" for page in DOCS[1:]} - links
    assert "docs/deploy.md#a-ray-cluster" in links and "docs/performance.md" in links and "docs/cli.md" in links
    assert len(README.read_text().splitlines()) <= 250


def all_parsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(words, parser) of ``raytrain-mp`` and of every command and command group under it, in the
    parser's order."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, (*words, name))


def command_parsers(parser: argparse.ArgumentParser):
    """``all_parsers`` less the groups that only name their commands (``data``, ``bench``)."""
    for words, sub in all_parsers(parser):
        if not words or not any(isinstance(action, argparse._SubParsersAction) for action in sub._actions):
            yield words, sub


def test_every_help_ends_with_the_docs_page_that_covers_it():
    from raytrain_mp.cli import build_parser

    for words, parser in all_parsers(build_parser()):
        last = parser.format_help().rstrip().splitlines()[-1]
        pages = re.findall(r"(?:README\.md|docs/[\w-]+\.md)", last)
        assert last.startswith("docs: ") and pages, (words, last)
        assert all((REPO / page).is_file() for page in pages), (words, last)


def cli_page_sections() -> dict[str, str]:
    """docs/cli.md's sections by heading (``raytrain-mp ddp``, ...)."""
    parts = re.split(r"^## (.+)$", CLI_PAGE.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_cli_page_names_every_option_of_every_command():
    """docs/cli.md is each command's ``--help``; a new option (or command) that it lacks fails here:
    ``python tests/test_readme.py`` writes it anew."""
    from raytrain_mp.cli import build_parser

    sections = cli_page_sections()
    commands = {" ".join(("raytrain-mp", *words)): parser for words, parser in command_parsers(build_parser())}
    assert list(sections) == list(commands), "docs/cli.md is stale: python tests/test_readme.py writes it anew"
    for heading, parser in commands.items():
        options = {
            option for action in parser._actions for option in action.option_strings if action.help != argparse.SUPPRESS
        }
        missing = {option for option in options if not re.search(rf"{re.escape(option)}\b", sections[heading])}
        assert not missing, (
            f"docs/cli.md's {heading} lacks {sorted(missing)}: python tests/test_readme.py writes it anew"
        )


def write_cli_page() -> None:
    """docs/cli.md: the ``--help`` of ``raytrain-mp`` and of each of its commands, 100 columns wide."""
    from raytrain_mp.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    sections = []
    for words, parser in command_parsers(build_parser()):
        sections.append(f"## {' '.join(('raytrain-mp', *words))}\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    CLI_PAGE.write_text(CLI_INTRO + "\n" + "\n".join(sections))


CLI_INTRO = """# Every option of every command

Task: look up what an option does and its default. Each section below is a command's `--help`,
its options grouped by concern (data, model, optimization, distribution, checkpoints, output), as
`raytrain-mp COMMAND --help` prints it:

```bash
raytrain-mp ddp --help                               # every option with its default
```

Options also come from a YAML file, `--config FILE`, with underscores in their names (flags win;
see [ddp](ddp.md)). What the options do together: [README](../README.md) and the page each `--help`
ends with. `python tests/test_readme.py` writes this page anew from the parser.
"""


def write_cifar_tree(root: Path) -> None:
    """A small tree in the format of the cifar-10-python tarball (bytes keys, (N, 3072) uint8)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, size=8).tolist()
        batch = {b"labels": labels, b"data": rng.integers(0, 256, size=(8, 3072), dtype=np.uint8)}
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": names}, protocol=2))


def write_photo_tree(root: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, size=(80, 96, 3), dtype=np.uint8)).save(root / label / f"{i}.jpg")


def last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


README_S3 = "127.0.0.1:9000"  # the endpoint of docs/storage.md's commands
README_BUCKET = "raytrain"


@pytest.fixture(scope="module")
def readme_s3():
    """An S3 protocol server (moto) where docs/storage.md expects one, with its bucket."""
    import logging

    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    host, port = README_S3.split(":")
    server = ThreadedMotoServer(ip_address=host, port=int(port), verbose=False)
    server.start()  # fails loudly if port 9000 is taken: the docs' commands name it
    fs, _ = pafs.FileSystem.from_uri(
        f"s3://{README_BUCKET}?endpoint_override={README_S3}&scheme=http&allow_bucket_creation=true"
    )
    fs.create_dir(README_BUCKET)
    yield
    server.stop()


def check_s3_output(command: str, out: str) -> None:
    """A docs/storage.md command: what it reports is in the bucket, and nothing went to a local "s3:" folder."""
    from raytrain_mp.data import read_meta
    from raytrain_mp.storage import locate

    if command.startswith("raytrain-mp data prepare"):
        assert read_meta(command.split('--out "')[1].split('"')[0]).counts["train"] == 1438
        return
    result = last_json(out)
    assert result["epochs"] == 1 and result["run"].startswith(f"s3://{README_BUCKET}/runs/")
    for key in ("checkpoint", "model"):
        assert result[key].endswith(f"?endpoint_override={README_S3}&scheme=http"), result[key]
    assert (
        locate(result["model"], "--weights").is_file()
        and locate(result["run"], "--storage-path").child("result.json").is_file()
    )


def check_output(command: str, out: str, home: Path, work: Path) -> None:
    """What each command must have produced, beyond exit code 0."""
    assert not list(work.glob("s3:*")), "a URI was written as a local folder"
    if '"s3://' in command:
        check_s3_output(command, out)
    elif command.startswith("pip install -e . && raytrain-mp ddp"):
        accuracy = re.findall(r"epoch 6/6 .*val_accuracy (\d\.\d+)", out)
        assert accuracy and float(accuracy[-1]) >= 0.95, out[-2000:]
        assert list((home / ".cache" / "raytrain_mp").iterdir())  # digits prepared into the default cache
    elif command.startswith("raytrain-mp data prepare"):
        out_dir = work / command.split("--out ")[1].split()[0]
        assert (out_dir / "metadata.json").is_file()
    elif command.startswith("raytrain-mp ddp --data") and "--num-workers 1-2" in command:  # elastic, on one machine
        result = last_json(out)
        assert result["epochs"] == 1 and result["world_size_history"] == [[0, 2]], out[-2000:]
        assert "2 workers on 1 node from step 0" in out
    elif command.startswith("raytrain-mp ddp --data"):
        result = last_json(out)
        assert result["epochs"] == 2 and result["world_size"] == 2 and result["global_batch_size"] == 128
    elif command.startswith("raytrain-mp ddp --config run.yaml"):
        assert list((home / "ray_results" / "digits-yaml").glob("checkpoint_*/model.pt"))
    elif command.endswith("--help"):
        assert "--global-batch-size" in out and "--no-sync-bn" in out
    elif command.startswith("raytrain-mp pipeline"):
        assert "stage 1:" in out
        assert ("balance trial: cut before " in out) == ("--balance-trials" in command), out[-2000:]
    elif command.startswith("raytrain-mp tune --global"):
        rows = (home / "ray_results" / "lr-sweep" / "sweep_table.csv").read_text().splitlines()
        assert len(rows) == 1 + 2 and (home / "ray_results" / "lr-sweep" / "best.yaml").is_file()


@pytest.fixture(scope="module")
def fresh_user(tmp_path_factory, readme_s3):
    """A HOME with the files the docs' commands expect to find there, and an empty work folder."""
    home = tmp_path_factory.mktemp("home")
    write_cifar_tree(home / "cifar-10-batches-py")
    write_photo_tree(home / "photos")
    work = tmp_path_factory.mktemp("work")
    (work / "run.yaml").write_text(doc_blocks("yaml")[0] + "\n")  # docs/ddp.md's run.yaml
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTRAIN_MP_CACHE")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    return home, work, env


@pytest.mark.slow  # the main job, sweeps and benches as a user types them: minutes
@pytest.mark.parametrize("command", RUN_HERE, ids=[f"{i:02d}" for i in range(len(RUN_HERE))])
def test_readme_command_runs_word_for_word(fresh_user, command):
    """In DOCS order: later commands use what earlier ones made (data/digits, ~/ray_results/lr-sweep)."""
    home, work, env = fresh_user
    # `pip install -e .` installs the clone it runs in; every other command runs in a fresh folder.
    cwd = REPO if command.startswith("pip install -e .") else work
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    check_output(command, done.stdout, home, work)


@pytest.mark.slow
def test_readme_python_snippet_loads_the_main_jobs_model(fresh_user):
    home, work, env = fresh_user
    runs = sorted((home / "ray_results").glob("ddp-*/checkpoint_*/model.pt"))
    assert runs, "the main job (`raytrain-mp ddp`) runs first"
    shutil.copy(runs[0], work / "model.pt")
    (snippet,) = [block for block in doc_blocks("python") if "load_state_dict" in block]  # docs/runs.md
    done = subprocess.run(["python", "-c", snippet], cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def one_box_script() -> str:
    scripts = [script for script in doc_scripts() if "ray start --head" in block_commands(script)]
    assert len(scripts) == 1, f"docs/deploy.md's one-box `ray start` ... `ray stop` block, marked {SCRIPT_MARK!r}"
    return scripts[0]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A copy of this clone with ``.venv``, an environment that sees this one's packages, as the
    one-box block expects (``source .venv/bin/activate``, then ``--working-dir .``)."""
    root = tmp_path_factory.mktemp("clone") / "raytrain_mp"
    local = {".git", ".venv", "build", "dist", "runs", ".cache", "data"}  # at the top: what a clone lacks

    def ignore(folder: str, names: list[str]) -> set[str]:
        anywhere = {name for name in names if name in ("__pycache__", ".pytest_cache") or name.endswith(".egg-info")}
        return anywhere | (local & set(names) if Path(folder) == REPO else set())

    shutil.copytree(REPO, root, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", root / ".venv"], check=True
    )
    return root


def run_one_box(script: str, clone: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``script`` as one ``bash -e`` script in ``clone``, as a user types it, in private PID, network
    and mount namespaces: its ``ray start`` and ``ray stop`` see only its own Ray (a bare ``ray
    stop`` would stop every Ray on the machine), its default ports (6379, 8265) are its own
    127.0.0.1's, and whatever it leaves running dies with the namespace. HOME is private (``~/.ray``,
    ``~/ray_results``, the data cache) and so is Ray's temp dir (its ``ray_current_cluster``, read by
    ``--address auto``). Without ``unshare`` (root, as here and in CI) this fails; it never skips."""
    home = tmp_path / "home"
    home.mkdir()
    temp_dir = Path(f"/tmp/rtob-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    shutil.rmtree(temp_dir, ignore_errors=True)
    temp_dir.mkdir()
    (tmp_path / "one_box.sh").write_text(script + "\n")
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAYTRAIN_MP_CACHE", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HOME=str(home), TMPDIR=str(temp_dir), RAY_USAGE_STATS_ENABLED="0")
    inside = f"ip link set lo up && exec bash -e -x {tmp_path / 'one_box.sh'}"
    try:
        return subprocess.run(
            ["unshare", "--pid", "--fork", "--net", "--mount-proc", "bash", "-c", inside],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_readme_one_box_script_runs_word_for_word(clone, tmp_path):
    """The one-box block, activate to ``ray stop``: both jobs train on the node it starts, and it is
    token-authenticated (the block's own ``ray get-auth-token --generate`` makes the token before
    ``ray start``, as any earlier local run would)."""
    done = run_one_box(one_box_script(), clone, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file()
    assert out.count("epoch 1/1") >= 2, out[-5000:]  # `raytrain-mp --address auto` and the submitted job
    assert re.search(r"Job '\S+' succeeded", out), out[-5000:]
    assert len(list((tmp_path / "home" / "ray_results").glob("ddp-*/checkpoint_*/model.pt"))) == 2


@pytest.mark.slow
def test_one_box_script_without_ray_auth_mode_is_refused(clone, tmp_path):
    """The control: the same block less its ``export RAY_AUTH_MODE=token`` (which the one-box section
    once lacked) is refused at ``ray job submit``, so the line above is load-bearing. Its
    ``raytrain-mp --address auto`` line is left out too, which sends the token on its own when
    ~/.ray/auth_token exists: tests/test_deploy.py's
    test_joining_a_token_cluster_uses_the_token_without_ray_auth_mode trains on a token head without
    RAY_AUTH_MODE, and the test above joins with ``--address auto``."""
    lines = one_box_script().splitlines()
    kept = [line for line in lines if not line.startswith(("export RAY_AUTH_MODE=token", "raytrain-mp ddp --address"))]
    assert len(kept) == len(lines) - 2
    done = run_one_box("\n".join(kept), clone, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-5000:]
    assert "+ ray job submit " in out, out[-5000:]  # it got as far as the submission (bash -x echoes it)
    assert "Unauthorized: Missing authentication token" in out, out[-5000:]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # this clone's raytrain_mp, whichever one pip installed
    write_cli_page()
