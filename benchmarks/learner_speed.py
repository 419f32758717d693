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
  graph            --cudagraphs: the whole iteration in one CUDA graph, replayed as a run
                   does (train_step; + bf16 on CUDA); on a CPU the stand-in, for a dry run
  cudagraphs       the same with torch.compile's losses inside the graph (CUDA only)
Each row also gives the kernels an update launches (CUDA kernels, or aten ops on a CPU,
counted by torch.profiler over one eager iteration) and the launches from Python per update:
as many as the kernels eager, 1 / updates per iteration through the graph.
Prints a table (median of --repeats timings) and writes JSON, rewritten after every row, so a
run stopped by a time limit keeps the rows it finished. With --interleave the modes of one
shape are timed in turn, one timing each per repeat, so that a slow spell of a shared
machine costs them alike (their rows are written once all repeats are done).

How far from the machine's limit: each row also gives the matmul FLOPs of one update
(counted by torch.utils.flop_counter over an eager iteration of the same shapes, divided by
its updates), the machine's matmul peak in the row's dtype (bf16 where the mode uses
autocast, else float32), measured in the same run on the same threads (the best of a few
shapes, the learner's own among them), and the fraction of the limit the learner reaches:
updates/s / (peak / FLOPs per update).

    python benchmarks/learner_speed.py --device cpu --batch-sizes 256 --hidden 256 \
        --threads 1 --modes eager compile-amp --profile prof   # where an update's time goes

--profile DIR: torch.profiler over one timing of each setting; its Chrome trace goes to DIR
and the busiest operators (self time) are printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.graph import IterationGraph  # noqa: E402


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
    modes: list[str] = field(default_factory=lambda: ["eager", "amp", "compile", "graph",
                                                      "cudagraphs"])
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
    profile: str | None = None
    """write a torch.profiler trace of one timing of each setting to this folder and print
    the operators that take the most time"""
    recipe: bool = False
    """time only the script's own defaults for --device (its recipe's batch, updates per
    iteration and widths, its fast-path flags): the isolated rate that a run's in-run
    updates/s is compared with (learner_efficiency)"""


MODES = {"eager": dict(compile=False, amp=False), "amp": dict(compile=False, amp=True),
         "compile": dict(compile=True, amp=None), "compile-amp": dict(compile=True, amp=True),
         "graph": dict(compile=False, amp=None, cudagraphs=True),
         "cudagraphs": dict(compile=True, amp=None, cudagraphs=True)}  # (None: on with CUDA)


def setting_args(b: Bench, hidden: int, batch: int, mode: str):
    script = importlib.import_module(b.script)
    flags = {k: (b.device == "cuda" if v is None else v) for k, v in MODES[mode].items()}
    return script.resolve_args(script.Args(
        env=b.env, device=b.device, batch_size=batch, updates_per_iter=b.updates_per_iter,
        actor_hidden=hidden, critic_hidden=b.critic_hidden or hidden,
        buffer_size=max(1_000_000, 2 * batch),
        prefetch=False, **flags), check_shm=False)  # (no replay buffer is created here)


def make_learner(b: Bench, args):
    """`args`'s learner and a batch of random data for one iteration, on the device."""
    script = importlib.import_module(b.script)
    obs_dim, act_dim, low, high = script.env_dims(args.env)
    device = torch.device(b.device)
    learner = script.Learner(args, obs_dim, act_dim, low, high, device)
    n = args.batch_size * args.updates_per_iter
    g = torch.Generator(device=device).manual_seed(0)
    batch_data = {
        "obs": torch.randn(n, obs_dim, device=device, generator=g),
        "next_obs": torch.randn(n, obs_dim, device=device, generator=g),
        "actions": torch.rand(n, act_dim, device=device, generator=g) * 0.8 - 0.4,
        "rewards": torch.randn(n, device=device, generator=g),
        "discounts": torch.full((n,), 0.97, device=device),
    }
    return learner, batch_data


def prepare_learner(b: Bench, args, profile_name: str | None = None):
    """`args`'s learner after its warm-up iterations, as a function that times --iterations
    iterations and returns their updates/s (the first timing under torch.profiler, with
    --profile)."""
    cuda = b.device == "cuda"
    learner, batch_data = make_learner(b, args)
    step = learner.train_iteration
    if args.cudagraphs:  # the whole iteration's graph, replayed as a run does (train_step)
        script = importlib.import_module(b.script)
        loop = types.SimpleNamespace(learner=learner, args=args, graph=IterationGraph(
            lambda x: script.graphed_iteration(learner, x), learner, learner.STATE,
            learner.device))

        def step(x):
            metrics = script.train_step(loop, x)
            if loop.graph is None:
                raise RuntimeError("the capture failed (see the warning above)")
            return metrics

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(b.warmup):
        step(batch_data)
    sync()
    todo = [profile_name] if b.profile and profile_name else []

    def timed() -> float:
        prof = profiler(b) if todo else contextlib.nullcontext()
        with prof:
            t0 = time.perf_counter()
            for _ in range(b.iterations):
                metrics = step(batch_data)
            sync()
            seconds = time.perf_counter() - t0
        if todo:
            report_profile(b, prof, todo.pop(), b.iterations * args.updates_per_iter)
        assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
        return b.iterations * args.updates_per_iter / seconds
    return timed


def profiler(b: Bench):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if b.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def report_profile(b: Bench, prof, name: str, updates: int) -> None:
    """The trace to --profile/NAME.json, and the operators with the most self time, per
    update."""
    os.makedirs(b.profile, exist_ok=True)
    prof.export_chrome_trace(os.path.join(b.profile, f"{name}.json"))
    key = "self_cuda_time_total" if b.device == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in rows)
    print(f"-- {name}: {total / updates / 1e3:.2f} ms of operator self time per update")
    for e in rows[:15]:
        print(f"   {getattr(e, key) / updates / 1e3:7.3f} ms  {100 * getattr(e, key) / total:5.1f}%"
              f"  x{e.count / updates:5.1f}  {e.key}")


def flops_per_update(b: Bench, args) -> float:
    """Matmul FLOPs of one update: torch's flop counter over one eager iteration of `args`'s
    shapes (the same arithmetic as every mode), divided by its updates."""
    from torch.utils.flop_counter import FlopCounterMode

    eager = dataclasses.replace(args, compile=False, amp=False, cudagraphs=False)
    learner, batch_data = make_learner(b, eager)
    with FlopCounterMode(display=False) as counter:
        learner.train_iteration(batch_data)
    return counter.get_total_flops() / args.updates_per_iter


def kernels_per_update(b: Bench, args) -> float:
    """Kernels one eager update launches: the CUDA kernels (on a CPU the innermost aten ops)
    that torch.profiler sees in one iteration of `args`'s shapes, divided by its updates."""
    learner, batch_data = make_learner(b, dataclasses.replace(args, compile=False))
    learner.train_iteration(batch_data)  # (the optimizers' state exists from here on)
    with profiler(b) as prof:
        learner.train_iteration(batch_data)
        if b.device == "cuda":
            torch.cuda.synchronize()
    if b.device == "cuda":
        n = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    else:
        n = sum(e.name.startswith("aten::") and not e.cpu_children for e in prof.events())
    return n / args.updates_per_iter


def matmul_peak(device: str, dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> dict:
    """GFLOP/s of plain matmuls (m x k times k x n) on this device and these threads: the
    best of `shapes` is the peak."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(k, n, device=device).to(dtype)

        def seconds(reps: int) -> float:
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ w
            sync()
            return time.perf_counter() - t0

        seconds(2)  # (warm-up)
        # about 0.2 s a timing at any speed (bf16 on a CPU without it: 1.2 GFLOP/s, 1.7 s a
        # 1024-cubed matmul on a 2-core AMD EPYC)
        reps = min(max(1, int(0.2 / seconds(1))), 2000)
        best = max(2 * m * k * n * reps / seconds(reps) / 1e9 for _ in range(3))  # (best of 3)
        out[f"{m}x{k}x{n}"] = round(best, 1)
    return out


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
    peaks = {}  # (threads, dtype, hidden, batch) -> GFLOP/s of each shape

    def write():
        with open(b.out, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "env": b.env,
                       "rows": rows}, f, indent=2)

    def report(hidden, batch, mode, runs, flops, kernels):
        bf16 = MODES[mode]["amp"] is not False and (MODES[mode]["amp"] or b.device == "cuda")
        dtype = torch.bfloat16 if bf16 else torch.float32
        key = (torch.get_num_threads(), dtype, hidden, batch)
        if key not in peaks:  # the learner's first layers, and a large square one
            obs_act = sum(importlib.import_module(b.script).env_dims(b.env)[:2])
            square = 4096 if b.device == "cuda" else 1024  # (a GPU needs more to fill it)
            peaks[key] = matmul_peak(b.device, dtype, [(square, square, square),
                                                       (batch, obs_act, hidden),
                                                       (batch, hidden, hidden // 2)])
        peak = max(peaks[key].values())
        row = (dict(updates_per_s=float(np.median(runs)), runs=runs) if isinstance(runs, list)
               else dict(updates_per_s=None, error=runs))
        limit = peak * 1e9 / flops  # updates/s if only the matmuls took time, at the peak
        rows.append(dict(threads=torch.get_num_threads(), hidden=hidden,
                         critic_hidden=b.critic_hidden or hidden, batch=batch,
                         updates_per_iter=b.updates_per_iter, mode=mode) | row | dict(
            gflop_per_update=round(flops / 1e9, 4), dtype=str(dtype).split(".")[-1],
            matmul_gflops=peaks[key], limit_updates_per_s=round(limit, 1),
            of_limit=row["updates_per_s"] and float(f"{row['updates_per_s'] / limit:.4g}"),
            kernels_per_update=round(kernels, 1), launches_per_update=round(
                1 / b.updates_per_iter if MODES[mode].get("cudagraphs") else kernels, 3)))
        write()
        speed = (f"{row['updates_per_s']:8.1f}" if row["updates_per_s"]
                 else "  failed " + row["error"])
        print(f"threads {rows[-1]['threads']:2d} | hidden {hidden:4d} | batch {batch:5d} | "
              f"{mode:11s} | updates/s {speed} | {flops / 1e9:.3f} GFLOP/update | "
              f"{rows[-1]['dtype']} peak {peak:6.1f} GFLOP/s | limit {limit:6.1f} | "
              f"of limit {rows[-1]['of_limit']} | launches/update "
              f"{rows[-1]['launches_per_update']} (kernels {rows[-1]['kernels_per_update']})",
              flush=True)

    for threads in b.threads:
        if threads:
            torch.set_num_threads(threads)
        for hidden in b.hidden:
            for batch in b.batch_sizes:
                modes = [m for m in b.modes if m != "cudagraphs" or b.device == "cuda"]
                flops = flops_per_update(b, setting_args(b, hidden, batch, "eager"))
                kernels = kernels_per_update(b, setting_args(b, hidden, batch, "amp"))
                # one group of all modes with --interleave, else a group per mode (so that a
                # mode's learner is gone before the next one's is built)
                for group in [modes] if b.interleave else [[m] for m in modes]:
                    timers, rates = {}, {}
                    for mode in group:
                        try:
                            name = f"{mode}_t{torch.get_num_threads()}_h{hidden}_b{batch}"
                            timers[mode] = prepare_learner(
                                b, setting_args(b, hidden, batch, mode), name)
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
                        report(hidden, batch, mode, rates[mode], flops, kernels)


if __name__ == "__main__":
    main(tyro.cli(Bench))
