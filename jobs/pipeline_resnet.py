"""Entry script for `ray job submit --working-dir . -- python jobs/pipeline_resnet.py [pipeline options]`.

Runs `raytrain-mp pipeline` with the given options on the cluster the job runs on (RAY_ADDRESS).
"""

import sys

from raytrain_mp.cli import main

if __name__ == "__main__":
    sys.exit(main(["pipeline", *sys.argv[1:]]))
