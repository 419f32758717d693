"""What --trace costs: learner updates/s of the same run with and without it, side by side.

    python benchmarks/trace_overhead.py --env Humanoid-v5 --pairs 3 --total-timesteps 12000

Each pair starts both runs at the same moment (same seed, same flags but --trace), so both
see the same load on the machine; the figure is the median over pairs of the ratio of
updates/s since the first update (summary.json), traced over untraced. On a busy machine
that ratio is noisy, so two figures without scheduling noise follow: the learner's own
iteration (train_iteration on a Humanoid-sized batch, CPU recipe) timed with its timeline
on and off in alternation in this process, and the cost of one recorded phase.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass
class Overhead:
    env: str = "Humanoid-v5"
    script: str = "fast_sac.py"
    pairs: int = 3
    total_timesteps: int = 12_000
    extra: list[str] = field(default_factory=list)
    """more flags for both runs"""
    rounds: int = 30
    """alternations of the in-process learner measurement (0: skip it)"""


def phase_cost_us(n: int = 200_000) -> float:
    from common.trace import Timeline

    tl = Timeline(40_000, "bench", 0)
    t0 = time.perf_counter()
    mark = tl.now()
    for _ in range(n):
        mark = tl.phase("learner/update_critic", mark)
    return (time.perf_counter() - t0) / n * 1e6


def learner_ratio(env: str, rounds: int, iterations: int = 3) -> tuple[float, float, float]:
    """(median ratio of iteration rates with/without the timeline, ms per iteration without,
    with), alternating on and off so that both see the same machine."""
    import torch

    import fast_sac as fs
    from common.replay import batch_shapes
    from common.trace import NO_TIMELINE, Timeline

    args = fs.resolve_args(fs.Args(env=env, device="cpu"), check_shm=False)
    torch.set_num_threads(1)
    obs_dim, act_dim, low, high = fs.env_dims(args.env)
    learner = fs.Learner(args, obs_dim, act_dim, low, high, torch.device("cpu"))
    rows = args.batch_size * args.updates_per_iter
    batch = {k: torch.randn(shape) * 0.1 for k, shape in batch_shapes(rows, obs_dim,
                                                                       act_dim).items()}
    timeline = Timeline(40_000, "bench", 0)
    times = {False: [], True: []}
    learner.train_iteration(batch)  # (warm-up)
    for _ in range(rounds):
        for traced in (False, True):
            learner.timeline = timeline if traced else NO_TIMELINE
            t0 = time.perf_counter()
            for _ in range(iterations):
                learner.train_iteration(batch)
            times[traced].append((time.perf_counter() - t0) / iterations)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    ratios = [a / b for a, b in zip(times[False], times[True])]
    return statistics.median(ratios), off * 1e3, on * 1e3


def main(o: Overhead) -> None:
    flags = ["--env", o.env, "--total-timesteps", str(o.total_timesteps), "--eval-interval",
             "0", "--eval-episodes", "1", "--quiet", *o.extra]
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(o.pairs):
            procs, dirs = [], []
            for traced in (False, True):
                run_dir = os.path.join(tmp, f"{pair}_{int(traced)}")
                dirs.append(run_dir)
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.join(ROOT, o.script), *flags, "--run-dir", run_dir,
                     *(["--trace"] if traced else [])], cwd=ROOT, stdout=subprocess.DEVNULL))
            if any(p.wait() != 0 for p in procs):
                raise SystemExit(f"pair {pair}: a run failed")
            ups = []
            for run_dir in dirs:
                with open(os.path.join(run_dir, "summary.json")) as f:
                    ups.append(json.load(f)["perf"]["updates_per_s_since_first_update"])
            ratios.append(ups[1] / ups[0])
            print(f"pair {pair}: updates/s without {ups[0]:.1f}, with --trace {ups[1]:.1f}, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
    if ratios:
        print(f"median ratio over {o.pairs} pairs: {statistics.median(ratios):.3f}")
    if o.rounds:
        ratio, off, on = learner_ratio(o.env, o.rounds)
        print(f"learner iteration alone, {o.rounds} alternations: {off:.1f} ms without, "
              f"{on:.1f} ms with the timeline; median ratio of rates {ratio:.3f}")
    print(f"one recorded phase costs {phase_cost_us():.2f} us in this process")


if __name__ == "__main__":
    main(tyro.cli(Overhead))
