"""Learner updates/s of fast_sac.py (or fast_td3.py) for each fast-path setting, on a fixed
random batch.

    python benchmarks/learner_speed.py --device cuda                  # the GPU comparison
    python benchmarks/learner_speed.py --device cpu --batch-sizes 128 256 512 --hidden 256 \
        --modes eager --threads 1 2                                   # CPU shapes and threads
    python benchmarks/learner_speed.py --device cpu --batch-sizes 256 --hidden 256 \
        --modes eager compile-amp --threads 1 --interleave            # the CPU recipe in bf16

For every (hidden width, batch size, mode, threads) it times `Learner.train_iteration` on a
batch already on the device (so it measures the update loop alone: no sampling, no copies),
after warm-up iterations that also absorb compilation. Modes:
  eager            plain PyTorch (float32)
  amp              bf16 autocast
  compile          torch.compile of the losses (+ bf16 autocast on CUDA)
  compile-amp      torch.compile of the losses + bf16 autocast, on any device
  cudagraphs       compile in reduce-overhead mode: CUDA graphs (+ bf16 on CUDA; CUDA only)
Prints a table (median of --repeats timings) and writes JSON, rewritten after every row, so a
run stopped by a time limit keeps the rows it finished. With --interleave the modes of one
shape are timed in turn, one timing each per repeat, so that a slow spell of a shared
machine costs them alike (their rows are written once all repeats are done).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass
class Bench:
    script: Literal["fast_sac", "fast_td3"] = "fast_sac"
    """whose Learner is timed"""
    env: str = "Humanoid-v5"
    """env whose observation and action sizes the networks take"""
    device: str = "cuda"
    """cuda or cpu"""
    batch_sizes: list[int] = field(default_factory=lambda: [8192])
    """mini-batch sizes"""
    hidden: list[int] = field(default_factory=lambda: [512, 768])
    """network widths (the actor's; the critics' too unless --critic-hidden is given)"""
    critic_hidden: int | None = None
    """the critics' width, if not --hidden's (the GPU recipe: actor 512, critics 1024)"""
    modes: list[str] = field(default_factory=lambda: ["eager", "amp", "compile", "cudagraphs"])
    """fast-path settings to compare"""
    threads: list[int] = field(default_factory=lambda: [0])
    """torch CPU threads (0: leave as is)"""
    updates_per_iter: int = 8
    """updates per timed iteration"""
    iterations: int = 10
    """timed iterations per repeat"""
    warmup: int = 3
    """untimed iterations first (compilation happens here)"""
    repeats: int = 3
    """timings per setting; the median is reported"""
    out: str = "benchmarks/learner_speed.json"
    """where the JSON goes"""
    interleave: bool = False
    """time the modes of one shape in turn, one timing each per repeat (fair ratios on a
    shared machine), instead of one mode after another"""
    recipe: bool = False
    """time only the script's own defaults for --device (its recipe's batch, updates per
    iteration and widths, its fast-path flags): the isolated rate that a run's in-run
    updates/s is compared with (learner_efficiency)"""


def prepare_setting(b: Bench, hidden: int, batch: int, mode: str):
    cuda = b.device == "cuda"
    flags = {"eager": dict(compile=False, amp=False), "amp": dict(compile=False, amp=True),
             "compile": dict(compile=True, amp=cuda),
             "compile-amp": dict(compile=True, amp=True), "cudagraphs": dict(
                 compile=True, amp=cuda, cudagraphs=True)}[mode]
    script = importlib.import_module(b.script)
    return prepare_learner(b, script.resolve_args(script.Args(
        env=b.env, device=b.device, batch_size=batch, updates_per_iter=b.updates_per_iter,
        actor_hidden=hidden, critic_hidden=b.critic_hidden or hidden,
        buffer_size=max(1_000_000, 2 * batch),
        prefetch=False, **flags), check_shm=False))  # (no replay buffer is created here)


def prepare_learner(b: Bench, args):
    """`args`'s learner after its warm-up iterations, as a function that times --iterations
    iterations and returns their updates/s."""
    cuda = b.device == "cuda"
    script = importlib.import_module(b.script)
    obs_dim, act_dim, low, high = script.env_dims(args.env)
    device = torch.device(b.device)
    learner = script.Learner(args, obs_dim, act_dim, low, high, device)
    batch = args.batch_size
    n = batch * args.updates_per_iter
    g = torch.Generator(device=device).manual_seed(0)
    batch_data = {
        "obs": torch.randn(n, obs_dim, device=device, generator=g),
        "next_obs": torch.randn(n, obs_dim, device=device, generator=g),
        "actions": torch.rand(n, act_dim, device=device, generator=g) * 0.8 - 0.4,
        "rewards": torch.randn(n, device=device, generator=g),
        "discounts": torch.full((n,), 0.97, device=device),
    }

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(b.warmup):
        learner.train_iteration(batch_data)
    sync()

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(b.iterations):
            metrics = learner.train_iteration(batch_data)
        sync()
        assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
        return b.iterations * args.updates_per_iter / (time.perf_counter() - t0)
    return timed


def main(b: Bench) -> None:
    if b.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu")
    if b.recipe:
        script = importlib.import_module(b.script)
        args = script.resolve_args(script.Args(env=b.env, device=b.device, prefetch=False),
                                   check_shm=False)
        timed = prepare_learner(b, args)
        rates = [timed() for _ in range(b.repeats)]
        result = {"recipe": {k: getattr(args, k) for k in (
            "batch_size", "updates_per_iter", "actor_hidden", "critic_hidden", "compile", "amp")},
            "updates_per_s": float(np.median(rates)), "runs": rates}
        print(json.dumps(result))
        with open(b.out, "w") as f:
            json.dump(result, f, indent=2)
        return
    rows = []
    device_name = torch.cuda.get_device_name() if b.device == "cuda" else "cpu"

    def write():
        with open(b.out, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "env": b.env,
                       "rows": rows}, f, indent=2)

    def report(hidden, batch, mode, runs):
        row = (dict(updates_per_s=float(np.median(runs)), runs=runs) if isinstance(runs, list)
               else dict(updates_per_s=None, error=runs))
        rows.append(dict(threads=torch.get_num_threads(), hidden=hidden,
                         critic_hidden=b.critic_hidden or hidden, batch=batch,
                         updates_per_iter=b.updates_per_iter, mode=mode) | row)
        write()
        speed = (f"{row['updates_per_s']:10.1f}" if row["updates_per_s"]
                 else "    failed " + row["error"])
        print(f"threads {rows[-1]['threads']:2d} | hidden {hidden:4d} | batch {batch:5d} | "
              f"{mode:11s} | updates/s {speed}", flush=True)

    for threads in b.threads:
        if threads:
            torch.set_num_threads(threads)
        for hidden in b.hidden:
            for batch in b.batch_sizes:
                modes = [m for m in b.modes if m != "cudagraphs" or b.device == "cuda"]
                # one group of all modes with --interleave, else a group per mode (so that a
                # mode's learner is gone before the next one's is built)
                for group in [modes] if b.interleave else [[m] for m in modes]:
                    timers, rates = {}, {}
                    for mode in group:
                        try:
                            timers[mode] = prepare_setting(b, hidden, batch, mode)
                            rates[mode] = []
                        except Exception as e:  # report and go on: a failing mode is a result
                            rates[mode] = f"{type(e).__name__}: {e}"[:300]
                    for _ in range(b.repeats):
                        for mode in list(timers):
                            try:
                                rates[mode].append(timers[mode]())
                            except Exception as e:
                                rates[mode] = f"{type(e).__name__}: {e}"[:300]
                                del timers[mode]
                    for mode in group:
                        report(hidden, batch, mode, rates[mode])


if __name__ == "__main__":
    main(tyro.cli(Bench))
