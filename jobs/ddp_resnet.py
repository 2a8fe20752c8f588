"""Entry script for `ray job submit --working-dir . -- python jobs/ddp_resnet.py [ddp options]`.

Runs `raytrain-mp ddp` with the given options. Under `ray job submit`, RAY_ADDRESS points at the
cluster the job runs on, so the trainer joins it instead of starting a local Ray.
"""

import sys

from raytrain_mp.cli import main

if __name__ == "__main__":
    sys.exit(main(["ddp", *sys.argv[1:]]))
