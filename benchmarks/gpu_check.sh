#!/usr/bin/env bash
# The one prepared device check for a machine with a GPU (written for the H200 lent by the
# device tool; about 8 minutes). Prints the numbers the performance figures in README.md
# quote and leaves JSON in ${OUT:-/tmp}. Run from the repository root:
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available())"
# learner updates/s: eager vs bf16 vs compiled vs CUDA graphs, batch 8192, hidden 512/768
timeout 300 python benchmarks/learner_speed.py --device cuda --batch-sizes 8192 \
    --hidden 512 768 --out "$OUT/learner_speed.json"
# collector_scaling with every core of the machine
timeout 150 python benchmarks/throughput.py --scaling-only --repeats 1 \
    --out "$OUT/scaling.json"
# the whole GPU path end to end: defaults for CUDA (compile, bf16, prefetch, collectors)
timeout 150 python fast_sac.py --env Humanoid --total-timesteps 60000 --eval-interval 0 \
    --eval-episodes 2 --log-interval 10 --run-dir "$OUT/run" && \
    python -c "import json; d = json.load(open('$OUT/run/summary.json')); \
print(d['status'], d['total_env_steps'], d['num_updates'], d['perf'])"
