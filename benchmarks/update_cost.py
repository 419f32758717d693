"""Per-update cost of a script's Learner (fast_sac.py by default) against an older
checkout's, interleaved in one process: at a small batch, where Python and launch overhead
show, or at the CPU recipe's sizes with its fast path.

    git archive 0b3bc0f | tar -x -C /tmp/before
    python benchmarks/update_cost.py --before /tmp/before --batch 16 --hidden 32
    python benchmarks/update_cost.py --before /tmp/before --batch 256 --hidden 256 \
        --updates-per-iter 8 --compile --amp --script fast_td3

Both learners train on the same random batch (Humanoid-v5 sizes, one torch thread);
the figure is the thread's CPU time per update (median over --repeats), which other
processes sharing the cores disturb far less than wall time. Prints one JSON line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass
class Bench:
    before: str
    """root of the older checkout (its script is loaded beside this one's)"""
    script: Literal["fast_sac", "fast_td3"] = "fast_sac"
    batch: int = 16
    hidden: int = 32
    updates_per_iter: int = 32
    amp: bool = False
    compile: bool = False
    repeats: int = 30
    """timings per learner (3 iterations each), interleaved"""


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main(b: Bench) -> None:
    torch.set_num_threads(1)
    learners = {}
    for name, root in (("before", b.before), ("after", ROOT)):
        fs = load(f"{b.script}_{name}", os.path.join(root, f"{b.script}.py"))
        torch.manual_seed(0)
        args = fs.resolve_args(fs.Args(
            env="Humanoid-v5", device="cpu", batch_size=b.batch,
            updates_per_iter=b.updates_per_iter, actor_hidden=b.hidden, critic_hidden=b.hidden,
            compile=b.compile, amp=b.amp, prefetch=False), check_shm=False)
        obs_dim, act_dim, low, high = fs.env_dims(args.env)
        learners[name] = fs.Learner(args, obs_dim, act_dim, low, high, torch.device("cpu"))
    g, n = torch.Generator().manual_seed(0), b.batch * b.updates_per_iter
    batch = {"obs": torch.randn(n, obs_dim, generator=g),
             "next_obs": torch.randn(n, obs_dim, generator=g),
             "actions": torch.rand(n, act_dim, generator=g) * 0.8 - 0.4,
             "rewards": torch.randn(n, generator=g), "discounts": torch.full((n,), 0.97)}
    for learner in learners.values():  # (warm-up)
        for _ in range(3):
            learner.train_iteration(batch)
    ms = {name: [] for name in learners}
    for _ in range(b.repeats):
        for name, learner in learners.items():
            t0 = time.thread_time()
            for _ in range(3):
                learner.train_iteration(batch)
            ms[name].append((time.thread_time() - t0) / (3 * b.updates_per_iter) * 1000)
    med = {name: round(float(np.median(v)), 4) for name, v in ms.items()}
    print(json.dumps({"script": b.script, "batch": b.batch, "hidden": b.hidden,
                      "compile": b.compile, "amp": b.amp,
                      "cpu_ms_per_update": med,
                      "after_over_before": round(med["after"] / med["before"], 3)}))


if __name__ == "__main__":
    main(tyro.cli(Bench))
