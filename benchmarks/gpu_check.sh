#!/usr/bin/env bash
# The one prepared device check for a machine with a GPU (written for the H200 lent by the
# device tool; at most about 8 minutes). Prints the numbers the performance figures in
# README.md quote and leaves them in ${OUT:-/tmp} as it goes. Run from the repository root:
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
# The lent machine has torch, numpy, tensorboard and tqdm but no gymnasium, mujoco or tyro,
# and no package index: `bash benchmarks/fetch_wheels.sh` here puts their wheels in .whl/,
# which travels with the call (carry [".whl"]) and is installed below.
#
# What comes back from $OUT (at most 8 files, so one log for all steps):
#   gpu_check.log       every step's output, with its command, timeout, exit status and time
#   learner_speed.json  updates/s per mode (eager, bf16, compile, CUDA graphs) and width
#   sample_time.json    one iteration's sample: host gather vs mirror (ms)
#   scaling.json        collector_scaling for K = 1 .. 14
#   run_summary.json    the end-to-end run's summary.json
#   learner_alone.json  the run's learner timed alone (for learner_efficiency)
# Each step runs under `timeout`: its own cap, and never past the whole check's budget.
set -u -o pipefail
START=$SECONDS
BUDGET_S=${GPU_CHECK_BUDGET_S:-465}   # the whole check, wheel install included
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1   # a step stopped by its timeout still leaves what it printed
FAILED=""

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" || { echo "wheel install failed" |
        tee -a "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# step NAME CAP_S CMD...: CMD under timeout (CAP_S, or what is left of the budget if less),
# its stdout and stderr shown and appended to the log
step() {
    local name=$1 cap=$2 left t t0 rc
    shift 2
    left=$((BUDGET_S - (SECONDS - START)))
    t=$((cap < left ? cap : left))
    if [ "$t" -lt 20 ]; then
        echo "== $name: skipped, ${left}s of the budget left" | tee -a "$LOG"
        FAILED="$FAILED $name"
        return 1
    fi
    echo "== $name (timeout ${t}s): $*" | tee -a "$LOG"
    t0=$SECONDS
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || FAILED="$FAILED $name"
    echo "== $name: exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (timed out)')" |
        tee -a "$LOG"
    return "$rc"
}

# the machine, and the packages every later step imports (nothing else can run without them)
step machine 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step packages 60 python3 -c "import sys, os, torch, typing_extensions, gymnasium, mujoco, tyro
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.is_available(), 'cores', len(os.sched_getaffinity(0)))
print('gymnasium', gymnasium.__version__, 'mujoco', mujoco.__version__, 'tyro', tyro.__version__)
e = gymnasium.make('Humanoid-v5'); e.reset(seed=0); e.step(e.action_space.sample())
print('Humanoid-v5 steps'); st = os.statvfs('/dev/shm')
print('/dev/shm free GiB', round(st.f_bavail * st.f_frsize / 2**30, 1))" || exit 1

# one iteration's sample (131,072 Humanoid rows): host gather + copy vs the GPU mirror
step sample_time 90 python3 benchmarks/sample_time.py --device cuda --out "$OUT/sample_time.json"
# collector_scaling: throughput.py runs K = 1 .. --max-collectors (no list of K), so 14
# covers K = 1, 2, 4, 8 and 14; it prints and writes only once every K has run
step collector_scaling 150 python3 benchmarks/throughput.py --scaling-only --repeats 1 \
    --max-collectors 14 --out "$OUT/scaling.json"
# the whole GPU path end to end: defaults for CUDA (compile, bf16, prefetch, collectors);
# the run folder (events, checkpoints) stays out of $OUT, its summary comes back
rm -rf /tmp/gpu_run
step fast_sac 150 python3 fast_sac.py --env Humanoid --total-timesteps 60000 --eval-interval 0 \
    --eval-episodes 2 --log-interval 10 --run-dir /tmp/gpu_run &&
    cp /tmp/gpu_run/summary.json "$OUT/run_summary.json" &&
    python3 -c "import json; d = json.load(open('/tmp/gpu_run/summary.json')); \
print(d['status'], d['total_env_steps'], d['num_updates'], d['perf'])" 2>&1 | tee -a "$LOG"
# learner_efficiency: that run's updates/s over the same learner (recipe, flags) alone
step learner_alone 120 python3 benchmarks/learner_speed.py --device cuda --recipe \
    --out "$OUT/learner_alone.json" &&
    python3 -c "import json; run = json.load(open('$OUT/run_summary.json'))['perf']; \
alone = json.load(open('$OUT/learner_alone.json'))['updates_per_s']; \
print('learner_efficiency', round(run['updates_per_s_since_first_update'] / alone, 3), \
'in run', run['updates_per_s_since_first_update'], 'alone', round(alone, 1))" 2>&1 |
    tee -a "$LOG"
# learner updates/s: eager vs bf16 vs compiled vs CUDA graphs, batch 8192, hidden 512/768;
# last, so that it has the rest of the budget (it prints a row per setting as it goes)
step learner_speed 300 python3 benchmarks/learner_speed.py --device cuda --batch-sizes 8192 \
    --hidden 512 768 --out "$OUT/learner_speed.json"
echo "== done in $((SECONDS - START))s; failed or skipped:${FAILED:- none}" | tee -a "$LOG"
[ -z "$FAILED" ]
