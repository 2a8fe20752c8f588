"""Entry script for `ray job submit --working-dir . -- python jobs/tune_lr.py [tune options]`.

Runs `raytrain-mp tune` with the given options (or `--resume EXPERIMENT` to finish an interrupted
sweep). Under `ray job submit`, RAY_ADDRESS points at the cluster the job runs on, so the sweep
joins it instead of starting a local Ray; use a `--storage-path` every node can reach (NFS, s3://).
"""

import sys

from raytrain_mp.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
