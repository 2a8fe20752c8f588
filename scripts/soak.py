"""Soak: SIGKILLs from outside at seeded random moments of a run, as spot instances and operators deal them.

Three trials, each in float64 with a checkpoint every 2 steps and ``--max-failures -1`` (unlimited), on a
tiny synthetic data set, against the same run left alone:

- ``ddp``: Ray Train workers (``ray::RayTrainWorker``) killed at random moments (half of them
  soon after the workers start, half soon after a new checkpoint: in steps, evaluations and
  checkpoint writes), every second kill followed by one of a new worker as the group restarts,
  and the run's board actor (``ray::Board``, the driver's progress lines) killed once;
- ``pipeline``: stage actors (``ray::StageWorker``) killed the same way, every second kill
  followed by one of a new stage actor while the stages are rebuilt;
- ``driver``: the ``raytrain-mp pipeline`` process itself SIGKILLed after its first checkpoint,
  then rerun with the same ``--name``.

Every trial must exit 0 and end with the uninterrupted run's model: the largest difference of
any tensor (``max_abs_diff``) at most 1e-9. The moments are drawn from ``--seed``; a kill lands
wherever the run then is (starting workers, loading a checkpoint, a step, a checkpoint write).

``tests/test_soak.py`` runs it small in the suite; ``python scripts/soak.py --faults 10`` runs
a longer one on a Ray of its own and prints one summary line (and ``--out``'s ``soak.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from raytrain_mp.cli import main as cli_main  # noqa: E402

from killer import Killer  # noqa: E402  (tests/killer.py: the kills from outside, shared with the suite)

TOLERANCE = 1e-9
STEP_CHECKPOINTS = ["--checkpoint-every-steps", "2"]


@dataclass
class Trial:
    """One soaked run: its exit code, the kills it survived, its model's largest difference from
    the uninterrupted run's, and the end of its output."""

    name: str
    code: int
    kills: list
    max_abs_diff: float | None
    tail: str

    @property
    def passed(self) -> bool:
        return self.code == 0 and self.max_abs_diff is not None and self.max_abs_diff <= TOLERANCE


def prepare_data(out: Path) -> str:
    """160 train / 40 val 8x8 grey images of 4 classes: 5 steps of 32 an epoch."""
    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import make_synthetic_source

    write_dataset(make_synthetic_source(200, 8, 4, 1, 0.2, 11), out)
    return str(out)


def argv(command: str, data: str, storage: str, name: str, epochs: int) -> list[str]:
    common = ["--no-use-gpu", "--data", data, "--precision", "fp64", "--global-batch-size", "32",
              "--epochs", str(epochs), "--storage-path", storage, "--name", name, "--log-every", "0",
              "--seed", "7"]  # fmt: skip
    if command == "ddp":
        return ["ddp", *common, "--num-workers", "2"]
    return ["pipeline", *common, "--stages", "2", "--microbatches", "4", "--schedule", "1f1b", "--balance", "params"]


def run(*args: str) -> tuple[int, str, dict | None]:
    """``raytrain-mp ARGS --json`` in this process: (exit code, output, JSON result or None)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        code = cli_main([*args, "--json"])
    output = buffer.getvalue()
    result = next((json.loads(line) for line in reversed(output.splitlines()) if line.startswith("{")), None)
    return code, output, result


def model_diff(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None:
        return None
    x, y = (torch.load(r["model"], map_location="cpu", weights_only=True) for r in (a, b))
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x if x[k].numel())


def reference(command: str, data: str, storage: str, epochs: int) -> dict:
    code, output, result = run(*argv(command, data, storage, "plain", epochs))
    if code != 0 or result is None:
        raise RuntimeError(f"the uninterrupted {command} run failed: {output[-2000:]}")
    return result


def soak_trainer(command: str, data: str, storage: str, seed: int, faults: int, epochs: int, plain: dict) -> Trial:
    """``faults`` random kills of ``command``'s workers or stage actors (every second one followed
    by a kill during the restart), and for ``ddp`` one of its board."""
    victims = "ray::RayTrainWorker" if command == "ddp" else "ray::StageWorker"
    with Killer(victims) as workers, Killer("ray::Board") as board:
        soaked = Path(storage) / "soaked"
        workers.start(
            lambda: workers.kill_at_random(seed, faults, gap_s=(0.5, 3.0), rebuild_every=2, checkpoints=soaked)
        )
        if command == "ddp":
            board.start(lambda: board.kill_at_random(seed + 1, 1, gap_s=(3.0, 10.0)))
        code, output, result = run(
            *argv(command, data, storage, "soaked", epochs), "--max-failures", "-1", *STEP_CHECKPOINTS
        )
    kills = workers.kills + board.kills
    return Trial(command, code, kills, model_diff(plain, result), output[-3000:])


def soak_driver(data: str, storage: str, seed: int, epochs: int, plain: dict, address: str) -> Trial:
    """A ``raytrain-mp pipeline`` process joined to ``address``, SIGKILLed a random moment after
    its first checkpoint, then rerun here with the same ``--name``."""
    args = [*argv("pipeline", data, storage, "driver", epochs), *STEP_CHECKPOINTS, "--address", address, "--json"]
    process = subprocess.Popen(["raytrain-mp", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_folder = Path(storage) / "driver"
    deadline = time.monotonic() + 600
    while not any(run_folder.glob("checkpoint_*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0.0, 2.0))
    killed = process.poll() is None
    if killed:
        process.send_signal(signal.SIGKILL)
    process.wait()
    code, output, result = run(*argv("pipeline", data, storage, "driver", epochs), *STEP_CHECKPOINTS)
    kills = [(None, process.pid, "raytrain-mp pipeline (driver)", "after its first checkpoint")] if killed else []
    return Trial("driver", code, kills, model_diff(plain, result), output[-3000:])


def soak(data: str, storage: str, seed: int, faults: int, epochs: int) -> list[Trial]:
    """The three trials on the connected Ray (the driver trial joins it by its address)."""
    import ray

    plains = {
        command: reference(command, data, str(Path(storage) / command), epochs) for command in ("ddp", "pipeline")
    }
    trials = [
        soak_trainer(c, data, str(Path(storage) / c), seed, faults, epochs, plains[c]) for c in ("ddp", "pipeline")
    ]
    address = ray.get_runtime_context().gcs_address
    trials.append(soak_driver(data, str(Path(storage) / "pipeline"), seed, epochs, plains["pipeline"], address))
    return trials


def summary(trials: list[Trial]) -> str:
    parts = [
        f"{t.name} {'passed' if t.passed else 'FAILED'}: exit {t.code}, {len(t.kills)} faults survived, "
        f"max abs diff {t.max_abs_diff if t.max_abs_diff is None else f'{t.max_abs_diff:.3g}'}"
        for t in trials
    ]
    return "soak: " + "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=10, help="random kills per trainer (plus those during restarts)")
    parser.add_argument("--seed", type=int, default=48)
    parser.add_argument(
        "--epochs", type=int, default=6, help="epochs of 5 steps (3 checkpoints each): enough to outlast the faults"
    )
    parser.add_argument("--out", default=None, help="where soak.json goes (and the runs, under runs/)")
    args = parser.parse_args()
    import ray

    out = Path(args.out or tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        started = time.monotonic()
        trials = soak(prepare_data(out / "data"), str(out / "runs"), args.seed, args.faults, args.epochs)
    finally:
        ray.shutdown()
    line = summary(trials)
    report = {
        "seed": args.seed,
        "faults": args.faults,
        "epochs": args.epochs,
        "seconds": round(time.monotonic() - started),
        "trials": [{**asdict(t), "passed": t.passed} for t in trials],
        "summary": line,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(line)
    print(f"soak: {report['seconds']} s; details in {out / 'soak.json'}")
    return 0 if all(t.passed for t in trials) else 1


if __name__ == "__main__":
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    sys.exit(main())
