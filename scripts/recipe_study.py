"""The recipe study of docs/recipes.md: the old augmentation against torchvision's recipe, with and
without its weight average, over seeds, on a data set small enough for augmentation to matter.

Data: the built-in digits with its training split cut to ``--train`` samples (the full validation
split, 359 samples), made photos' size and range: upsampled to ``--image-size`` (bilinear) and
scaled from their 0..16 to 0..255, the range the auto-augment policies' photometric ops
(solarize, posterize, equalize) assume; on the stored 0..16 they make images 15 times brighter than
any the model validates on. Arms, each a ``raytrain-mp ddp`` run per seed on one local Ray, 1 worker:

- ``plain``: ``--augment`` (pad-crop and flip), what a run had before the recipe;
- ``recipe``: the same plus ``RECIPE`` (torchvision's reference options: TrivialAugment, random
  erasing, mixup/cutmix, label smoothing) and ``--model-ema``; its figure is the model's
  ``val_accuracy``;
- ``recipe+ema``: that same run's weight average, ``val_accuracy_ema``. The average is a side
  copy: it changes nothing of the model's training, so one run gives both figures (the study checks
  it once: seed 0 again without ``--model-ema`` ends with the same ``val_accuracy``).

Writes ``study.json`` (every run's figures, each arm's mean, standard deviation, min and max) and
``study.png`` (each arm's mean with its seeds as points) into ``--out``, and prints one line per arm.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from raytrain_mp.cli import main as cli_main

RECIPE = [
    "--auto-augment", "ta_wide", "--random-erase", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
    "--label-smoothing", "0.1",
]  # fmt: skip
EMA = ["--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.99"]


def write_digits_as_photos(out: Path, train: int, size: int) -> str:
    """The digits, their training split cut to ``train`` samples, as ``size`` x ``size`` images in 0..255."""
    import dataclasses

    import torch

    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import RawSplit, load_digits_source

    raw = load_digits_source()

    def as_photos(split: RawSplit, n: int) -> RawSplit:
        pixels = torch.from_numpy(split.images[:n]).permute(0, 3, 1, 2).float() * (255 / 16)
        pixels = torch.nn.functional.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
        images = pixels.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        return RawSplit(images, split.labels[:n], split.ids[:n])

    write_dataset(dataclasses.replace(raw, train=as_photos(raw.train, train), val=as_photos(raw.val, None)), out)
    return str(out)


def run(data: str, storage: str, name: str, seed: int, epochs: int, *extra: str) -> dict:
    """One ddp run's --json summary (its own output kept off the terminal)."""
    argv = [
        "ddp", "--no-use-gpu", "--data", data, "--num-workers", "1", "--global-batch-size", "32",
        "--base-lr", "0.4", "--warmup-epochs", "2", "--epochs", str(epochs), "--seed", str(seed),
        "--storage-path", storage, "--name", name, "--quiet", "--json", "--augment", *extra,
    ]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(argv)
    if code != 0:
        raise SystemExit(f"recipe study: {name} exited {code}")
    return json.loads(next(line for line in reversed(out.getvalue().splitlines()) if line.startswith("{")))


def figures(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def plot(path: Path, arms: dict[str, list[float]], title: str) -> None:
    from raytrain_mp.plots import png_bytes, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    means = [statistics.mean(values) for values in arms.values()]
    bars = ax.bar(range(len(arms)), means, color="#4C72B0", alpha=0.7)
    ax.bar_label(bars, labels=[f"{m:.3f}" for m in means], padding=3)
    for x, values in enumerate(arms.values()):
        ax.scatter([x] * len(values), values, color="black", zorder=3, s=14)
    ax.set_xticks(range(len(arms)), list(arms))
    low = min(min(values) for values in arms.values())
    ax.set_ylim(max(0.0, low - 0.1), 1.0)
    ax.set_ylabel("final val accuracy (bar: mean; points: seeds)")
    ax.set_title(title, fontsize=9)
    path.write_bytes(png_bytes(fig, dpi=120))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for study.json and study.png")
    parser.add_argument("--train", type=int, default=300, help="training samples of the digits cut")
    parser.add_argument("--image-size", type=int, default=16, help="side the digits are upsampled to")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    import ray

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runs: dict[str, dict[int, dict]] = {"plain": {}, "recipe": {}}
    with tempfile.TemporaryDirectory(prefix="recipe-study-") as scratch:
        data = write_digits_as_photos(Path(scratch) / "digits", args.train, args.image_size)
        storage = str(Path(scratch) / "runs")
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            for seed in range(args.seeds):
                runs["plain"][seed] = run(data, storage, f"plain-{seed}", seed, args.epochs)
                runs["recipe"][seed] = run(data, storage, f"recipe-{seed}", seed, args.epochs, *RECIPE, *EMA)
            without_ema = run(data, storage, "recipe-0-no-ema", 0, args.epochs, *RECIPE)
        finally:
            ray.shutdown()
    arms = {
        "plain": [r["val_accuracy"] for r in runs["plain"].values()],
        "recipe": [r["val_accuracy"] for r in runs["recipe"].values()],
        "recipe+ema": [r["val_accuracy_ema"] for r in runs["recipe"].values()],
    }
    report = {
        "data": f"digits as {args.image_size}x{args.image_size} grey photos in 0..255: {args.train} training and "
        "359 validation samples",
        "settings": {"epochs": args.epochs, "seeds": args.seeds, "recipe": RECIPE, "ema": EMA},
        "runs": {arm: {str(seed): result for seed, result in by_seed.items()} for arm, by_seed in runs.items()},
        "arms": {arm: {"values": values, **figures(values)} for arm, values in arms.items()},
        "ema_leaves_the_model_alone": without_ema["val_accuracy"] == runs["recipe"][0]["val_accuracy"],
        "seconds": round(time.monotonic() - started),
    }
    (out / "study.json").write_text(json.dumps(report, indent=2) + "\n")
    title = (
        f"ResNet-18 on digits as {args.image_size}x{args.image_size} photos ({args.train} training samples), "
        f"{args.epochs} epochs, {args.seeds} seeds"
    )
    plot(out / "study.png", arms, title)
    for arm, stats in report["arms"].items():
        spread = f"+- {stats['std']:.4f} (min {stats['min']:.4f}, max {stats['max']:.4f})"
        print(f"{arm}: val accuracy {stats['mean']:.4f} {spread}")
    alone = report["ema_leaves_the_model_alone"]
    print(f"recipe study: {report['seconds']} s; the weight average left the model alone: {alone}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
