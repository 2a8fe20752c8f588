"""GPU check of the data path (issue 13), for a machine with CUDA; on CPU it skips cleanly (exit 0).

What it measures, into ``OUT/gpu_check_data.json`` (and one summary line on stdout):
1. ``transforms``: the device-side batch transforms on CUDA against the same batch on the CPU:
   the uint8 crop and flip exactly, float64 exactly, float32 within 1e-6.
2. ``decode``: torchvision's batched ``decode_jpeg`` on the GPU (nvJPEG) against the CPU decode
   of the same JPEG files (not bit-exact: nvJPEG's IDCT rounds differently; the max difference
   is reported, not asserted).
3. ``data_bound``: ``raytrain-mp ddp --use-gpu --num-workers 1`` end to end on synthetic 224x224
   data (ResNet-50, bf16, the default loader processes of ``--cpus-per-worker``) against the same
   model and training step fed with a batch already on the GPU; their ratio says how much of
   the GPU's speed the data path delivers (1.0: not data-bound).

Usage: ``python scripts/gpu_check_data.py [--out DIR] [--cpus-per-worker N] [--num-samples N]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def check_transforms(scratch: Path) -> dict:
    from raytrain_mp.data import ParquetImageDataset
    from raytrain_mp.data.prepare import prepare
    from raytrain_mp.data.transforms import crop_flip

    prepare("synthetic", scratch / "t", num_samples=256, image_size=64, seed=1)
    ds = ParquetImageDataset(str(scratch / "t"), "train", augment=True, seed=3)
    images, _, params = ds.batch((1, i) for i in range(128))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    uint8_equal = torch.equal(
        crop_flip(images.cuda(), params, ds.transform.pad).cpu(), crop_flip(images, params, ds.transform.pad)
    )
    fp64_equal = torch.equal(
        ds.transform(images, params, cuda, torch.float64).cpu(), ds.transform(images, params, cpu, torch.float64)
    )
    fp32_diff = (
        (ds.transform(images, params, cuda, torch.float32).cpu() - ds.transform(images, params, cpu, torch.float32))
        .abs()
        .max()
        .item()
    )
    passed = uint8_equal and fp64_equal and fp32_diff <= 1e-6
    return {
        "uint8_crop_flip_equal": uint8_equal,
        "fp64_equal": fp64_equal,
        "fp32_max_abs_diff": fp32_diff,
        "passed": passed,
    }


def check_decode(scratch: Path) -> dict:
    import io

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images
    from torchvision.io import ImageReadMode, decode_jpeg

    files = []
    for photo in load_sample_images().images:
        buffer = io.BytesIO()
        Image.fromarray(photo).save(buffer, format="JPEG", quality=90)
        files.append(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
    on_gpu = decode_jpeg(files, mode=ImageReadMode.RGB, device="cuda")
    on_cpu = [decode_jpeg(f, mode=ImageReadMode.RGB) for f in files]
    diffs = [(g.cpu().int() - c.int()).abs() for g, c in zip(on_gpu, on_cpu)]
    return {
        "images": len(files),
        "max_abs_diff": int(max(d.max() for d in diffs)),
        "mean_abs_diff": float(np.mean([d.float().mean().item() for d in diffs])),
    }


def resident_samples_per_second(batch: int, steps: int = 20, warmup: int = 5) -> float:
    """ResNet-50 bf16 training steps on a batch that already lives on the GPU."""
    from raytrain_mp.models import build_model

    model = build_model("resnet50", 10, 3, False).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - started)


def check_data_bound(scratch: Path, cpus: int, num_samples: int, batch: int) -> dict:
    data = scratch / "syn224"
    subprocess.run(["raytrain-mp", "data", "prepare", "synthetic", "--image-size", "224",
                    "--num-samples", str(num_samples), "--val-fraction", "0.05", "--out", str(data)],
                   check=True, capture_output=True)  # fmt: skip
    done = subprocess.run(
        ["raytrain-mp", "ddp", "--use-gpu", "--num-workers", "1", "--cpus-per-worker", str(cpus), "--model", "resnet50",
         "--precision", "bf16", "--augment", "--epochs", "2", "--global-batch-size", str(batch), "--data", str(data),
         "--storage-path", str(scratch / "runs"), "--log-every", "0", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    end_to_end = json.loads(done.stdout.strip().splitlines()[-1])["samples_per_second"]  # the second epoch: warm
    resident = resident_samples_per_second(batch)
    return {
        "end_to_end_samples_per_second": end_to_end,
        "gpu_resident_samples_per_second": resident,
        "fed_fraction": end_to_end / resident,
        "cpus_per_worker": cpus,
        "loader_workers": cpus - 1,
        "global_batch_size": batch,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_check_data.json")
    parser.add_argument(
        "--cpus-per-worker",
        type=int,
        default=8,
        help="the DDP worker's CPUs: 1 training process + the rest loader processes",
    )
    parser.add_argument("--num-samples", type=int, default=4096, help="synthetic 224x224 images for the end-to-end run")
    parser.add_argument("--global-batch-size", type=int, default=256)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA device: nothing to check on this machine"}
        (out / "gpu_check_data.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"gpu_check_data: skipped ({result['skipped']})")
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-data-") as tmp:
        scratch = Path(tmp)
        result = {
            "gpu": torch.cuda.get_device_name(0),
            "transforms": check_transforms(scratch),
            "decode": check_decode(scratch),
            "data_bound": check_data_bound(scratch, args.cpus_per_worker, args.num_samples, args.global_batch_size),
        }
    (out / "gpu_check_data.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"gpu_check_data: {json.dumps(result)}")
    return 0 if result["transforms"]["passed"] and "error" not in result["data_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
