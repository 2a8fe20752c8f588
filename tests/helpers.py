"""Helpers shared by tests: run the CLI in-process and capture its exit code and output."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytrain_mp.cli import main


def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


def session_gpus() -> int:
    """GPUs the session's Ray (conftest's ``ray_session``) advertises: ``RAYTRAIN_MP_TEST_RAY_GPUS``
    of them (a fake GPU cluster on a CPU machine), else this machine's CUDA devices."""
    import torch

    fake = os.environ.get("RAYTRAIN_MP_TEST_RAY_GPUS")
    return int(fake) if fake else torch.cuda.device_count()


def session_cpus() -> int:
    """CPUs the session's Ray advertises (logical ones): 4, or the GPUs + 2 where that is more, so
    that one unit more than the cluster has GPUs (DDP workers or pipeline stages of 1 CPU, a Tune
    trial's workers beside its 1-CPU driver) fits the CPUs and a test of too few GPUs reaches the
    GPU check, on a box of any GPU count."""
    return max(4, session_gpus() + 2)


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def last_json(self) -> dict:
        return json.loads(self.out.strip().splitlines()[-1])


def run_cli(capsys, *argv: str) -> CliResult:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors exit
        code = exc.code
    captured = capsys.readouterr()
    return CliResult(code, captured.out, captured.err)


# Ray forwards its actors' logs to the driver's stderr, prefixed "(ActorName pid=N)", possibly in
# colour: e.g. Ray Train's placement-group cleaners from earlier fits in the session, which warn
# every second when the session runs without a dashboard. They are Ray's lines, not the command's.
RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\((\w+ )?pid=\w+")
# The line a compiled run prints after each start's first step (``compilation.compiled_line``):
# (graphs read from the cache, graphs in all, the cache's folder).
COMPILED_LINE = re.compile(r"compiled in [0-9.]+ s: (\d+) of (\d+) graphs from the cache (\S+)")


def assert_usage_error(result: CliResult, *fragments: str) -> None:
    """Exit code 2 and a single ``error:`` line on stderr (besides Ray's forwarded logs and the
    tool's ``note:`` lines) holding every fragment."""
    assert result.code == 2, result
    lines = [
        line
        for line in result.err.strip().splitlines()
        if line.strip() and not RAY_FORWARDED.match(line) and not line.startswith("note: ")  # e.g. a device choice
    ]
    assert len(lines) == 1, lines
    assert "error:" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@contextlib.contextmanager
def timed(argv: Sequence[str]) -> Iterator[None]:
    """Writes to the test's stderr when a command started and how long it took (pytest shows it
    with a failed test's output): which run of a fixture's several spent a timeout."""
    command = f"raytrain-mp {argv[0]} {argv[argv.index('--name') + 1] if '--name' in argv else ''}"
    start = time.monotonic()
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} {command}: started\n")
    try:
        yield
    finally:
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {command}: {time.monotonic() - start:.1f} s\n")


def run_cli_json(*argv: str) -> dict:
    """Run a command that must succeed with ``--json`` and return its JSON result.

    Ray's log forwarding shares stdout, so the result is the last line that parses as a JSON object."""
    return run_cli_json_and_text(*argv)[0]


def run_cli_json_and_text(*argv: str) -> tuple[dict, str]:
    """``run_cli_json``'s result, and everything the command printed (the run's lines)."""
    import io

    buffer = io.StringIO()
    with timed(argv), contextlib.redirect_stdout(buffer):
        code = main([*argv, "--json"])
    assert code == 0, buffer.getvalue()[-3000:]
    for line in reversed(buffer.getvalue().splitlines()):
        if line.startswith("{"):
            return json.loads(line), buffer.getvalue()
    raise AssertionError(f"no JSON line in output: {buffer.getvalue()[-2000:]}")


def run_without(module: str, *argv: str):
    """``raytrain-mp ARGV`` in a new Python where ``module`` cannot be imported (an environment
    without an optional extra); the ``subprocess.CompletedProcess``, text."""
    import subprocess
    import sys

    code = (
        f"import sys; sys.modules[{module!r}] = None  # what an environment without it imports\n"
        f"from raytrain_mp.cli import main\nsys.exit(main({list(argv)!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def run_cli_text(*argv: str) -> tuple[int, str]:
    """``(exit code, stdout and stderr)`` of a command run in-process, failed or not (a run that
    raises is exit code 1, as the command line reports it)."""
    import io

    buffer = io.StringIO()
    with timed(argv), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            code = main(list(argv))
        except Exception as exc:  # a failed run: the command line prints the traceback and exits 1
            print(f"{type(exc).__name__}: {exc}")
            code = 1
    return code, buffer.getvalue()


def auth_mode_after_probe(address: str, env: dict[str, str]) -> str:
    """RAY_AUTH_MODE after ``cluster.use_token_if_the_cluster_asks(address)`` in a fresh process
    with ``env`` ("" when it left token authentication off), and what that process wrote to stderr."""
    import subprocess
    import sys

    code = (
        "import os, sys\nfrom raytrain_mp.cluster import use_token_if_the_cluster_asks\n"
        "use_token_if_the_cluster_asks(sys.argv[1])\nprint(os.environ.get('RAY_AUTH_MODE', ''))\n"
    )
    env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}  # the probe decides only where the user did not
    done = subprocess.run([sys.executable, "-c", code, address], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    return done.stdout.strip()


def load_model_pt(result: dict) -> dict:
    """The state dict of a run's ``--json`` result's ``model``."""
    import torch

    return torch.load(result["model"], map_location="cpu", weights_only=True)


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest difference over every tensor of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


def make_image_folder(root: Path, seed: int = 0) -> Path:
    """3 classes of 5 images each, JPEG and PNG of different sizes, smooth enough for JPEG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(3):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(5):
            h, w = (int(v) for v in rng.integers(40, 100, size=2))
            base = rng.uniform(30, 220, size=(4, 4, 3))
            pixels = np.kron(base, np.ones((h // 4 + 1, w // 4 + 1, 1)))[:h, :w] + rng.normal(0, 8, size=(h, w, 3))
            image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
            image.save(root / f"class{c}" / (f"{i}.jpg" if i % 2 else f"{i}.png"), quality=90)
    return root


def png16_bytes(samples: np.ndarray) -> bytes:
    """A 16-bit PNG file of uint16 ``samples``: (H, W) gray, (H, W, 2) gray+alpha, (H, W, 3) RGB or
    (H, W, 4) RGBA, made by hand (PIL writes 16-bit gray PNGs only)."""
    import struct
    import zlib

    samples = np.asarray(samples, dtype=np.uint16)
    h, w = samples.shape[:2]
    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[1 if samples.ndim == 2 else samples.shape[2]]
    rows = samples.reshape(h, -1).astype(">u2")
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter type 0 on every row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


MIXED_MODES = (
    "rgb.jpg",
    "gray.jpg",
    "cmyk.jpg",
    "rgba.png",
    "palette.png",
    "gray16.png",
    "rgb16.png",
    "la.png",
    "bilevel.png",
)


def mixed_mode_image_folder(root: Path, seed: int = 0) -> Path:
    """2 classes of one file per mode of ``MIXED_MODES`` each, every file at its own size (14 to 40
    px a side): RGB, gray (L) and CMYK JPEGs; RGBA, palette with transparency (P), 16-bit gray,
    16-bit RGB, gray+alpha (LA) and 1-bit PNGs. The modes PIL opens them in are the names' modes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(2):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for name in MIXED_MODES:
            h, w = (int(v) for v in rng.integers(14, 41, size=2))
            base = rng.uniform(30, 220, size=(3, 3, 3)) + 20 * c
            rgb = np.clip(
                np.kron(base, np.ones((h // 3 + 1, w // 3 + 1, 1)))[:h, :w] + rng.normal(0, 8, (h, w, 3)), 0, 255
            )
            image = Image.fromarray(rgb.astype(np.uint8))
            path = folder / name
            if name == "rgb.jpg":
                image.save(path, quality=90)
            elif name == "gray.jpg":
                image.convert("L").save(path, quality=90)
            elif name == "cmyk.jpg":
                image.convert("CMYK").save(path, quality=90)
            elif name == "rgba.png":
                Image.fromarray(np.dstack([rgb.astype(np.uint8), rng.integers(0, 256, (h, w), dtype=np.uint8)])).save(
                    path
                )
            elif name == "palette.png":
                palette = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
                palette.save(path, transparency=0)
            elif name == "gray16.png":
                Image.fromarray((rgb[..., 0] * 257).astype(np.uint16)).save(path)
            elif name == "rgb16.png":
                path.write_bytes(
                    png16_bytes(np.minimum(rgb.astype(np.int64) * 257 + rng.integers(0, 257, (h, w, 3)), 65535))
                )
            elif name == "la.png":
                Image.fromarray(np.dstack([rgb[..., 1], rgb[..., 2]]).astype(np.uint8)).save(path)  # LA
            else:
                image.convert("1").save(path)
    return root


def kill_actor(actor: object, timeout_s: float = 60.0) -> None:
    """``ray.kill`` the actor and return once it is dead: ``ray.kill`` only asks, and a call sent
    right after it can still run on the live actor (a test that expects the next step to fail
    would then see it pass)."""
    from raytrain_mp.pipeline.teardown import stop_actors

    if stop_actors([actor], timeout_s):
        raise AssertionError(f"the actor still answered {timeout_s:.0f} s after ray.kill")


def write_digits_cut(out: Path, train: int, val: int) -> str:
    """The built-in digits cut to its first ``train`` and ``val`` samples, prepared into ``out``:
    the same images at a fraction of the compute, for runs whose point is not the data set's size."""
    import dataclasses

    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import RawSplit, load_digits_source

    raw = load_digits_source()

    def cut(split: RawSplit, n: int) -> RawSplit:
        return RawSplit(split.images[:n], split.labels[:n], split.ids[:n])

    write_dataset(dataclasses.replace(raw, train=cut(raw.train, train), val=cut(raw.val, val)), out)
    return str(out)


def tiny_run(root: Path, command: str, *argv: str, train: int, val: int) -> dict:
    """One real epoch of ``command`` (ddp or pipeline) at global batch 32 on a ``train``/``val``
    cut of digits under ``root``: its ``--json`` result, with ``data`` and ``root``."""
    data = write_digits_cut(root / "digits", train=train, val=val)
    result = run_cli_json(command, "--data", data, "--epochs", "1", "--global-batch-size", "32", "--no-use-gpu",
                          "--storage-path", str(root / "runs"), *argv)  # fmt: skip
    return {**result, "data": data, "root": root}


def assert_ordinary_modes(*paths: str | Path) -> None:
    """Every file and folder at or under ``paths`` has the mode the umask gives an ordinary one
    (0644 and 0755 under umask 022): others can read what the tool wrote, as they can a ``cp``."""
    from raytrain_mp.storage import ordinary_mode

    modes = {}
    for path in map(Path, paths):
        for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
            modes[str(item)] = oct(item.stat().st_mode & 0o777)
    expected = {item: oct(ordinary_mode(folder=Path(item).is_dir())) for item in modes}
    assert modes == expected
