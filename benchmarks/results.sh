#!/usr/bin/env bash
# The README's results in one command: every run of its table (both scripts, seed 1), one
# after another, then the table and the figure together in OUT/curves.md (with each run's
# command, the CPU model, the date and the commit) and OUT/curves.png, each row beside SAC's
# published score at 1M env steps. Each run has 15 minutes, 2 hours 30 in all; minutes are
# wall time, so give it the machine alone. An interrupted sweep goes on where it stopped.
#   bash benchmarks/results.sh [OUT] [EXTRA: flags for every run, e.g. "--compile False"]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-curves}
C=(python benchmarks/curves.py --out-dir "$OUT" --extra "--eval-episodes 3 ${2:-}")
"${C[@]}" --envs HalfCheetah-v5 Hopper-v5 Walker2d-v5 Ant-v5 Humanoid-v5 --minutes 15
