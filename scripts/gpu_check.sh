#!/usr/bin/env bash
# Everything GPU-related, on whatever CUDA GPUs this machine has, in one command:
#   scripts/gpu_check.sh [OUT]        (OUT defaults to ./gpu_check)
# Steps: the tests marked `gpu` (NCCL DDP, native SyncBatchNorm, fp16, NCCL pipeline stages; each
# skips with its reason where there are too few GPUs), one Ray head for the steps after it,
# `bench ddp` and `bench pipeline` on GPUs (nn.DataParallel and the pipeline need 2+), the main job
# compiled (`ddp --compile`, one GPU, from an empty compile cache), and the data
# path's GPU check (scripts/gpu_check_data.py: device transforms vs the CPU, nvJPEG decode, and
# `raytrain-mp ddp --use-gpu --num-workers 1` end to end, which is the main job's path on one GPU).
# Each step's output goes to OUT/STEP.log; OUT/gpu_check.json is the report: per step the command,
# exit code, seconds, status (passed, failed, skipped) and the reason of a skip. Exit code 1 when a
# step failed.
# Budget: 8 minutes on one GPU box with 16 CPU cores (an H200), all steps together: each `step`
# line's limit (seconds) is its share, and they add up to at most 480
# (tests/test_gpu_readiness.py parses them). The benches therefore run reduced settings, chosen
# so that start-ups (Ray actors, Ray Train fits, torchrun with NCCL), not steps, fill the time:
# on a GPU a step of these models takes milliseconds, and every extra round, schedule or layout
# is another start-up. The full-size runs are `raytrain-mp bench ...` with their defaults
# (`bench pipeline` with all of them took 1915 s on CPU). The steps after `tests` join one Ray
# head (RAY_ADDRESS) instead of each starting and stopping a local Ray: on the H200 (gVisor, where
# starting processes is slow) the three steps that started their own ran past their limits.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu_check}
mkdir -p "$out"
steps="$out/steps.tsv"
: >"$steps"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
cpus=$(python -c "import os; print(os.cpu_count())")

# step NAME TIMEOUT_S COMMAND...: run it, log it, record "name rc seconds status reason command";
# returns the command's exit code
step() {
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS rc status=passed why=""
    echo "== $name: $*"
    # SIGTERM at the limit, SIGKILL 15 s later: on the H200 a `bench ddp` whose Ray head processes
    # got the SIGTERM too waited 60 s for its GCS before exiting (141 s against a limit of 80)
    timeout -k 15 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && status=failed
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out after $limit s"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" "$status" "$why" "$*" >>"$steps"
    tail -n 3 "$out/$name.log"
    return "$rc"
}

# skipped NAME REASON COMMAND...: record a step that cannot run on this machine, and why
skipped() {
    local name=$1 reason=$2
    shift 2
    echo "== $name: skipped, $reason"
    printf '%s\t\t0\tskipped\t%s\t%s\n' "$name" "$reason" "$*" >>"$steps"
}

step tests 160 python -m pytest -m gpu -v -rs -p no:cacheprovider tests
if [ "$gpus" -ge 1 ]; then
    # its own temp dir names every process of this Ray in its command line, so the exit trap ends
    # exactly those (never another Ray's, as `ray stop` would), and `address=auto` elsewhere never
    # finds this head after it is gone. Ray Train's placement-group cleaner, an actor, looks for the
    # state API through `auto` too (so in /tmp/ray, not here: 40 s timeouts and a 12 s stall at the
    # end of every fit) unless RAY_API_SERVER_ADDRESS, which every process of the head inherits, names it.
    ray_tmp=$(mktemp -d /tmp/gpu-check-ray.XXXXXX)
    trap 'pkill -KILL -f "$ray_tmp"; rm -rf "$ray_tmp"' EXIT
    read -r port dashboard_port < <(python -c "from raytrain_mp.cluster import free_port; print(free_port(), free_port())")
    # once the head is up, the steps join it; its GPUs are the ones they ask for, so a request it
    # cannot meet fails at once instead of waiting for an autoscaler
    RAY_API_SERVER_ADDRESS="http://127.0.0.1:$dashboard_port" RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 \
        step ray_head 30 ray start --head --port "$port" --dashboard-port "$dashboard_port" --num-cpus "$cpus" --num-gpus "$gpus" \
        --temp-dir "$ray_tmp" --disable-usage-stats && export RAY_ADDRESS="127.0.0.1:$port" RAYTRAIN_MP_AUTOSCALE_WAIT_S=0
    workers=$([ "$gpus" -ge 2 ] && echo 1,2 || echo 1)
    step bench_ddp 80 raytrain-mp bench ddp --use-gpu --num-workers "$workers" --cpus-per-worker 2 --batch-size-per-worker 128 \
        --steps 20 --warmup 5 --out "$out/bench_ddp"
    # the main job compiled, from an empty cache: its log's "compiled in" line is the cold first
    # step on a GPU, its "note:" (if any) says whether the compiled step lost to eager
    step compiled_ddp 60 raytrain-mp ddp --use-gpu --num-workers 1 --epochs 1 --compile --compile-cache "$out/compile_cache" \
        --storage-path "$out/runs" --name compiled
else
    skipped ray_head "no CUDA GPU" ray start --head --num-gpus 0
    skipped bench_ddp "no CUDA GPU" raytrain-mp bench ddp --use-gpu
    skipped compiled_ddp "no CUDA GPU" raytrain-mp ddp --use-gpu --compile
fi
if [ "$gpus" -ge 2 ]; then
    # every case of the bench, each once and small: one round of ours vs native (--resnet-rounds 1,
    # --overhead-rounds 1), m of 2 and 8 (1F1B needs m >= stages; the summary's overhead ratio is
    # at m=8), one timed trial of a balanced cut, one plain and one interleaved overhead schedule
    step bench_pipeline 70 raytrain-mp bench pipeline --use-gpu --stages 2 --cpus-per-stage 2 --threads 4 --microbatches 2,8 \
        --steps 5 --warmup 2 --resnet-rounds 1 --balance-trials 1 --overhead-rounds 1 --overhead-steps 10 \
        --overhead-microbatches 2,8 --overhead-schedules gpipe,interleaved-1f1b --out "$out/bench_pipeline"
else
    skipped bench_pipeline "2 stages need 2 GPUs (one each); this machine has $gpus" raytrain-mp bench pipeline --use-gpu --stages 2
fi
if [ -f scripts/gpu_check_data.py ]; then
    step data_path 80 python scripts/gpu_check_data.py --out "$out/data_path"
fi

python - "$out" "$gpus" "$cpus" <<'EOF'
import json, sys
from pathlib import Path

out, gpus, cpus = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
keys = ("name", "returncode", "seconds", "status", "reason", "command")
steps = [dict(zip(keys, line.split("\t"))) for line in (out / "steps.tsv").read_text().splitlines()]
for s in steps:
    s["returncode"] = int(s["returncode"]) if s["returncode"] else None
    s["seconds"] = int(s["seconds"])
    s["log"] = str(out / f"{s['name']}.log") if s["status"] != "skipped" else None
report = {"cuda_gpus": gpus, "cpu_count": cpus, "passed": all(s["status"] != "failed" for s in steps), "steps": steps}
(out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
print(json.dumps({"report": str(out / "gpu_check.json"), "passed": report["passed"],
                  "steps": {s["name"]: s["status"] for s in steps}}))
sys.exit(0 if report["passed"] else 1)
EOF
