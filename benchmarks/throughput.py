"""Throughput of fast_sac.py's collector and learner next to their limits.

    python benchmarks/throughput.py --env Humanoid-v5 [--quick]

collector_efficiency: env steps/s of the collector while it steps inside a real training run,
  over a bare gymnasium vector env stepping the same envs with random actions (1 process each).
learner_efficiency: updates/s of the learner inside the run (wall time from its first to its
  last update), over the same iteration (sample, copy, updates, publish) run alone on a
  filled buffer with the same thread count.
Each figure is the median of --repeats runs. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import fast_sac  # noqa: E402
from common.replay import ReplayBuffer  # noqa: E402
from common.weights import WeightSync  # noqa: E402


@dataclass
class Bench:
    env: str = "Humanoid-v5"
    """gymnasium id"""
    quick: bool = False
    """short runs (about two minutes on 2 cores)"""
    repeats: int = 3
    """repeats per figure; the median is reported"""
    out: str = "benchmarks/throughput.json"
    """where the JSON goes"""


def bare_env_steps_per_s(env_id: str, num_envs: int, seconds: float) -> float:
    envs = fast_sac.make_env(env_id, num_envs)
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    low, high = envs.single_action_space.low, envs.single_action_space.high
    shape = (num_envs, *low.shape)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        envs.step(rng.uniform(low, high, size=shape).astype(np.float32))
        steps += num_envs
    rate = steps / (time.perf_counter() - t0)
    envs.close()
    return rate


def full_run(env_id: str, total: int, learning_starts: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, os.path.join(ROOT, "fast_sac.py"), "--env", env_id, "--device",
               "cpu", "--total-timesteps", str(total), "--learning-starts",
               str(learning_starts), "--eval-interval", "0", "--eval-episodes", "1",
               "--run-dir", run_dir, "--log-interval", "1000"]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)


def isolated_updates_per_s(env_id: str, iterations: int) -> float:
    args = fast_sac.resolve_args(fast_sac.Args(env=env_id, device="cpu"))
    torch.set_num_threads(fast_sac.default_learner_threads())  # as the learner does
    obs_dim, act_dim, low, high = fast_sac.env_dims(args.env)
    learner = fast_sac.Learner(args, obs_dim, act_dim, low, high, torch.device("cpu"))
    cap = args.buffer_size // args.num_envs
    rb = ReplayBuffer.create(args.num_envs, cap, obs_dim, act_dim)
    ws = WeightSync.create(learner.actor)
    try:
        rng = np.random.default_rng(0)
        filled = 20_000 // args.num_envs
        rb.obs[:, :filled] = rng.normal(size=(args.num_envs, filled, obs_dim))
        rb.next_obs[:, :filled] = rb.obs[:, :filled]
        n = args.batch_size * args.updates_per_iter

        def iteration(version):
            batch = rb.sample(rng, n, args.n_step, args.gamma, filled, args.steps_per_iter)
            learner.train_iteration(fast_sac.to_device(batch, "cpu"))
            ws.publish(learner.actor, version)

        iteration(0)
        t0 = time.perf_counter()
        for i in range(iterations):
            iteration(i + 1)
        return iterations * args.updates_per_iter / (time.perf_counter() - t0)
    finally:
        rb.close(), rb.unlink(), ws.close(), ws.unlink()


def main(b: Bench) -> None:
    env_id = fast_sac.resolve_env_id(b.env)
    args = fast_sac.resolve_args(fast_sac.Args(env=env_id, device="cpu"))
    seconds, total, iters = (5, 12_000, 20) if b.quick else (15, 40_000, 60)
    rows = {"bare_env_steps_per_s": [], "collector_steps_per_s": [],
            "run_updates_per_s": [], "isolated_updates_per_s": []}
    for _ in range(b.repeats):
        rows["bare_env_steps_per_s"].append(bare_env_steps_per_s(env_id, args.num_envs, seconds))
        perf = full_run(env_id, total, learning_starts=total // 4)["perf"]
        rows["collector_steps_per_s"].append(perf["collector_steps_per_s"])
        rows["run_updates_per_s"].append(perf["updates_per_s_since_first_update"])
        rows["isolated_updates_per_s"].append(isolated_updates_per_s(env_id, iters))
    med = {k: float(np.median(v)) for k, v in rows.items()}
    result = {
        "env": env_id, "num_envs": args.num_envs, "repeats": b.repeats, "quick": b.quick,
        "medians": med, "runs": rows,
        "collector_efficiency": med["collector_steps_per_s"] / med["bare_env_steps_per_s"],
        "learner_efficiency": med["run_updates_per_s"] / med["isolated_updates_per_s"],
    }
    print(f"{'figure':32s} {'median':>10s}   runs")
    for k, v in rows.items():
        print(f"{k:32s} {med[k]:10.1f}   {', '.join(f'{x:.1f}' for x in v)}")
    print(f"{'collector_efficiency':32s} {result['collector_efficiency']:10.3f}")
    print(f"{'learner_efficiency':32s} {result['learner_efficiency']:10.3f}")
    with open(b.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Bench))
