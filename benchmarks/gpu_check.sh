#!/usr/bin/env bash
# The one prepared device check for a machine with a GPU (written for the H200 or H100 lent
# by the device tool, 15 minutes a session: the decisive steps take at most 560 s, which
# leaves time to rerun some; the others run as the budget allows). Run from the repository
# root:
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#     OUT=/tmp/gpu GPU_CHECK_STEPS="fast_sac multigpu" bash benchmarks/gpu_check.sh  # these only
#     OUT=/tmp/dry bash benchmarks/gpu_check.sh --dry-run    # no GPU: every step, tiny sizes
# The lent machine has torch, numpy, tensorboard and tqdm but no gymnasium, mujoco or tyro,
# and no package index: `bash benchmarks/fetch_wheels.sh` here puts their wheels in .whl/,
# which travels with the call (carry [".whl"]) and is installed below.
#
# Steps, most decisive first; each writes its results as it goes, so a step stopped by its
# time limit keeps what it finished. The first four always run (their limits add up to the
# budget); each later one runs only if the budget still holds its limit:
#   machine            GPU, driver, packages, /dev/shm and GPU memory; sizes the buffers
#   graph_equals_eager --cudagraphs against eager on the GPU recipe's shapes, from one state
#                      and the same batches (benchmarks/graph_check.py: its tolerance, and a
#                      stale-batch run that must fall outside it)
#   learner_speed      updates/s: bf16 eager, compile, the whole-iteration graph eager and
#                      compiled (the GPU recipe's shapes), each with the FLOPs of an update,
#                      the GPU's matmul peak in its dtype, the fraction of that limit the
#                      learner reaches and the kernels an update launches
#   learn              does the GPU recipe learn: python fast_sac.py --env Humanoid with the
#                      CUDA defaults and --cudagraphs for 5 minutes (benchmarks/curves.py
#                      stops it), evaluated every 25k env steps; minutes to 1,000 / 3,000 / 5,000
#   two_ranks          torchrun, two gloo ranks sharing the GPU (--share-device): the
#                      multi-GPU device code on one GPU; the ranks' parameters must agree
#   fast_sac           one end-to-end Humanoid-v5 run with the CUDA defaults
#   multigpu           torchrun, one rank, --cudagraphs: NCCL init, broadcast, the all-reduce
#                      inside the graph, barriers, exit
#   fast_td3           a short fast_td3.py run
#   cudagraphs         a short fast_sac.py --cudagraphs run (the learn step's flags, less time)
#   sample_time        one iteration's sample: host gather + copy vs the GPU mirror
#   collector_scaling  K = 1, 2, 4, 8 collectors
# What comes back from $OUT:
#   gpu_check.log       every step's output, with its command, time limit, exit status, time
#   graph_check.json    graph_equals_eager: the differences, the tolerance, PASS or FAIL
#   learner_speed.json  a row per mode, written after each
#   runs.jsonl          a line per training run: its summary.json, with the step's name
#   learn_curves.md/.json/.png  the learn step's curve (eval return against minutes, env
#                      steps) and its table
#   sample_time.json    host vs mirror (ms), written after each
#   scaling.json        collector_scaling, written after each K
# --dry-run: the CPU learner (gloo for torchrun), tiny sizes, the same steps and files; it
# is part of the test suite (tests/test_gpu_check.py), so the script is known to work
# before a device is lent.
set -u -o pipefail
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
START=$SECONDS
BUDGET_S=${GPU_CHECK_BUDGET_S:-560}   # the whole check, wheel install included
ONLY=${GPU_CHECK_STEPS:-}             # the steps to run (machine always runs); empty: all
INSTALL_S=15                          # kept for the wheel install
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: > "$LOG"
rm -f "$OUT/runs.jsonl"
WORK=$(mktemp -d)   # run folders: their events and checkpoints stay out of $OUT
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1   # a step stopped by its time limit still leaves what it printed
FAILED=""
SKIPPED=""

# each step's time limit (s). Sized from the first lent H200 (2026-12-04): a training run
# starts its first env step after about 20 s and compiles for 25 s more; fast_sac then
# collected 685 env steps/s in that first call, 1,330 in a later one (learner_speed compiles
# twice, plain and CUDA graphs: the later runs at the same shapes find those kernels in
# inductor's cache, fast_td3 compiles its own). learn: 5 minutes from its process start,
# then its checkpoint and the table
# graph_equals_eager: four learners on 5 iterations, each compiling its losses (the later
# three from inductor's cache)
declare -A CAP=([machine]=30 [graph_equals_eager]=75 [learner_speed]=110 [learn]=330
                [two_ranks]=55 [fast_sac]=85 [multigpu]=70 [fast_td3]=75 [cudagraphs]=85
                [sample_time]=40 [collector_scaling]=65)
DECISIVE=(machine graph_equals_eager learner_speed learn)   # always run: their limits fit
total=$INSTALL_S
for name in "${DECISIVE[@]}"; do total=$((total + CAP[$name])); done
if [ "$total" -gt "$BUDGET_S" ]; then
    echo "the decisive steps' limits add up to ${total}s, over the ${BUDGET_S}s budget" |
        tee -a "$LOG"
    exit 1
fi

if [ "$DRY" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    timeout "$INSTALL_S" python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" ||
        { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# step NAME CMD...: CMD under timeout (its CAP, or what is left of the budget if less), its
# stdout and stderr shown and appended to the log
step() {
    local name=$1 cap=${CAP[$1]} left t t0 rc
    shift
    if [ -n "$ONLY" ] && [ "$name" != machine ] && [[ " $ONLY " != *" $name "* ]]; then
        echo "== $name: not in GPU_CHECK_STEPS" | tee -a "$LOG"
        return 1
    fi
    left=$((BUDGET_S - (SECONDS - START)))
    t=$((cap < left ? cap : left))
    if [[ " ${DECISIVE[*]} " != *" $name "* ]] && [ "$left" -lt "$cap" ]; then
        echo "== $name: skipped, it needs ${cap}s and ${left}s of the budget are left" |
            tee -a "$LOG"
        SKIPPED="$SKIPPED $name"
        return 1
    fi
    if [ "$t" -lt 10 ]; then
        echo "== $name: skipped, ${left}s of the budget left" | tee -a "$LOG"
        FAILED="$FAILED $name"
        return 1
    fi
    echo "== $name (timeout ${t}s): $*" | tee -a "$LOG"
    t0=$SECONDS
    timeout -k 5 "$t" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || FAILED="$FAILED $name"
    echo "== $name: exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (timed out)')" |
        tee -a "$LOG"
    return "$rc"
}

# keep NAME DIR: append DIR's summary.json to runs.jsonl (one line, with the step's name)
keep() {
    python3 -c "import json, sys; s = json.load(open(sys.argv[2] + '/summary.json'))
open(sys.argv[3], 'a').write(json.dumps({'step': sys.argv[1]} | s) + '\n')
print(sys.argv[1], s['status'], s['total_env_steps'], 'env steps', s['num_updates'], 'updates',
      s['perf'])" "$1" "$2" "$OUT/runs.jsonl" 2>&1 | tee -a "$LOG"
}

if [ "$DRY" = 1 ]; then   # tiny sizes on the CPU; the same steps and files
    DEVICE=cpu
    SPEED=(--batch-sizes 32 --hidden 32 --updates-per-iter 2 --modes eager graph
           --iterations 2 --repeats 1 --warmup 1)
    GRAPH_CHECK=(--device cpu --dry-run)
    SIZES=(--device cpu --num-envs 2 --batch-size 32 --actor-hidden 32 --critic-hidden 32
           --num-atoms 21 --learning-starts 100 --steps-per-iter 10 --updates-per-iter 2
           --buffer-size 20000 --total-timesteps 200)
    SHORT=("${SIZES[@]}")
    GRAPHS=(--cudagraphs)   # (the CPU stand-in: compile stays off for these sizes)
    SAMPLE=(--device cpu --num-envs 4 --buffer-size 20000 --rows 1024 --iterations 2
            --gather-threads 1)
    SCALING=(--collectors 1 2 --steps-per-collector 80)
    LEARN=(--minutes 1 --eval-interval 100)
    LEARN_EXTRA="${SIZES[*]} --eval-episodes 1 --cudagraphs"
else
    DEVICE=cuda
    # the GPU recipe's shapes (batch 4096, 32 updates, actor 512, critics 1024), so that the
    # runs below find their compiled kernels in the cache these rows fill
    SPEED=(--batch-sizes 4096 --hidden 512 --critic-hidden 1024 --updates-per-iter 32
           --modes amp compile graph cudagraphs --iterations 5 --repeats 3 --warmup 3)
    GRAPH_CHECK=(--device cuda)
    SIZES=(--total-timesteps 25000)
    SHORT=(--total-timesteps 12000)
    GRAPHS=(--cudagraphs)
    SAMPLE=(--device cuda --iterations 5)
    SCALING=(--collectors 1 2 4 8)
    LEARN=(--minutes 5 --eval-interval 25000)
    LEARN_EXTRA="--eval-episodes 3 --cudagraphs"
fi
RUN=(--env Humanoid-v5 --eval-interval 0 --eval-episodes 2 --log-interval 10)

# the machine, the packages every later step imports, and the room for buffers: a replay
# buffer (and its GPU mirror) of at most half the free /dev/shm and a third of the free GPU
# memory (nothing else can run if this fails)
step machine python3 -c "import sys, os, torch, typing_extensions, typeguard, gymnasium, mujoco, tyro
from importlib.metadata import version
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.is_available(), 'cores', len(os.sched_getaffinity(0)))
print(*(f'{p} {version(p)}' for p in ('gymnasium', 'mujoco', 'tyro', 'typeguard',
                                      'typing_extensions', 'numpy')))
e = gymnasium.make('Humanoid-v5'); e.reset(seed=0); e.step(e.action_space.sample())
row = 4 * (2 * e.observation_space.shape[0] + e.action_space.shape[0] + 3)
st = os.statvfs('/dev/shm'); shm = st.f_bavail * st.f_frsize
rows = min(1_000_000, int(shm / 2 / row))
print('/dev/shm free GiB', round(shm / 2**30, 1))
if '$DEVICE' == 'cuda':
    print(torch.cuda.get_device_name(), 'free/total GiB',
          *(round(x / 2**30, 1) for x in torch.cuda.mem_get_info()))
    rows = min(rows, int(torch.cuda.mem_get_info()[0] / 3 / row))
print('replay buffer rows', rows, f'({rows * row / 2**30:.2f} GiB)')
open('$WORK/buffer_size', 'w').write(str(rows // 64 * 64))" || exit 1
BUF=(--buffer-size "$(cat "$WORK/buffer_size")")
[ "$DRY" = 1 ] && BUF=()   # (SIZES has its own)

step graph_equals_eager python3 benchmarks/graph_check.py "${GRAPH_CHECK[@]}" \
    --out "$OUT/graph_check.json"

step learner_speed python3 benchmarks/learner_speed.py --device "$DEVICE" "${SPEED[@]}" \
    --out "$OUT/learner_speed.json"

# (curves.py keeps the run dir in $WORK; only the table and the figure go to $OUT)
step learn python3 benchmarks/curves.py --scripts fast_sac --envs Humanoid-v5 --seeds 1 \
    "${LEARN[@]}" --extra "$LEARN_EXTRA ${BUF[*]}" --out-dir "$WORK/learn" &&
    keep learn "$WORK/learn/Humanoid-v5__fast_sac__1"
for f in curves.md curves.json curves.png; do
    [ -f "$WORK/learn/$f" ] && cp "$WORK/learn/$f" "$OUT/learn_$f"
done

if step two_ranks python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
    fast_sac_multigpu.py "${RUN[@]}" "${SHORT[@]}" "${BUF[@]}" --eval-episodes 1 \
    --share-device --dist-backend gloo --run-dir "$WORK/two_ranks"; then
    keep two_ranks "$WORK/two_ranks"
    python3 -c "import json
s = json.load(open('$WORK/two_ranks/summary.json'))
hashes = s['rank_param_hashes']
print('two ranks on one device:', s['backend'], s['world_size'], 'ranks, parameters',
      'identical' if len(set(hashes)) == 1 else 'DIFFER', hashes)
assert s['world_size'] == 2 and len(set(hashes)) == 1" 2>&1 | tee -a "$LOG" ||
        FAILED="$FAILED two_ranks(parameters)"
fi

step fast_sac python3 fast_sac.py "${RUN[@]}" "${SIZES[@]}" "${BUF[@]}" \
    --run-dir "$WORK/fast_sac" && keep fast_sac "$WORK/fast_sac" && [ "$DRY" = 0 ] &&
    [ -f "$OUT/learner_speed.json" ] &&
    python3 -c "import json  # the run's updates/s over its learner alone (same shapes, flags)
run = json.load(open('$WORK/fast_sac/summary.json'))['perf']['updates_per_s_since_first_update']
rows = json.load(open('$OUT/learner_speed.json'))['rows']
alone = [r['updates_per_s'] for r in rows if r['mode'] == 'compile' and r['updates_per_s']]
print('learner_efficiency', round(run / alone[0], 3) if alone and run else None, 'in run', run,
      'alone', alone[:1])" 2>&1 | tee -a "$LOG"

step multigpu python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    fast_sac_multigpu.py "${RUN[@]}" "${SHORT[@]}" "${BUF[@]}" "${GRAPHS[@]}" --eval-episodes 1 \
    --run-dir "$WORK/multigpu" && keep multigpu "$WORK/multigpu"

step fast_td3 python3 fast_td3.py "${RUN[@]}" "${SHORT[@]}" "${BUF[@]}" --eval-episodes 1 \
    --run-dir "$WORK/fast_td3" && keep fast_td3 "$WORK/fast_td3"

step cudagraphs python3 fast_sac.py "${RUN[@]}" "${SHORT[@]}" "${BUF[@]}" "${GRAPHS[@]}" \
    --eval-episodes 1 --run-dir "$WORK/cudagraphs" && keep cudagraphs "$WORK/cudagraphs"

step sample_time python3 benchmarks/sample_time.py "${SAMPLE[@]}" "${BUF[@]}" \
    --out "$OUT/sample_time.json"

step collector_scaling python3 benchmarks/throughput.py --scaling-only --repeats 1 \
    "${SCALING[@]}" --out "$OUT/scaling.json"

echo "== done in $((SECONDS - START))s; failed:${FAILED:- none}; skipped for time:${SKIPPED:- none}" |
    tee -a "$LOG"
[ -z "$FAILED" ]
