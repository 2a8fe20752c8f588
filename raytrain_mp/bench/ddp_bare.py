"""The bare side of ``raytrain-mp bench ddp``: a minimal torch.distributed DDP script for torchrun.

Job: join the process group torchrun describes (gloo on CPU, NCCL with one GPU per rank), run
``bench.ddp.measure_steps`` (the same steps the Ray Train side runs) and let rank 0 write its
figures as JSON. Run as
``python -m torch.distributed.run --standalone --nproc-per-node N -m raytrain_mp.bench.ddp_bare
--settings JSON --result PATH``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from raytrain_mp.bench.common import join_torchrun_group
from raytrain_mp.bench.ddp import measure_steps


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help="BenchDDPConfig.settings() as JSON")
    parser.add_argument("--result", required=True, help="where rank 0 writes its figures")
    args = parser.parse_args(argv)
    settings = json.loads(args.settings)
    device = join_torchrun_group(settings["use_gpu"])
    figures = measure_steps(settings, dist.get_rank(), dist.get_world_size(), device)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(figures))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
