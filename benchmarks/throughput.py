"""Throughput of fast_sac.py's collectors and learner next to their limits.

    python benchmarks/throughput.py --env Humanoid-v5 [--quick]

collector_efficiency: env steps/s of the collector while it steps inside a real training run,
  over a bare gymnasium vector env stepping the same envs with random actions (1 process each).
learner_efficiency: updates/s of the learner inside the run (wall time from its first to its
  last update), over the same iteration (sample, copy, updates, publish) run alone on a
  filled buffer with the same thread count and the same --compile and --amp.
  Both are measured for two thread settings on this machine: `default` (fast_sac.py's: one
  collector, learner threads = cores - 1, nobody shares a core) and `shared` (the learner
  takes every core, so it shares the collector's).
  The gap splits into three factors, each measured with the same 8 envs in one process:
  policy_over_random: the bare env stepping with the (untrained) actor's actions, acting
    included, over random actions: what the policy's forward pass and the physics under
    its actions cost;
  plumbing: one collector process alone (no learner; writes, weight reads, counters) over
    that bare policy-stepping env;
  in_run_over_alone: the collector inside the training run over the same collector alone:
    what sharing the machine with the learner costs.
overlap: training-phase throughput of a pipelined run over a lockstep run (default threads),
  with --updates-per-iter chosen so that learning an iteration takes about as long as
  collecting one (calibrated from the default runs). The limit is 2.
collector_scaling[K]: env steps/s of K real collector processes (4 envs each, acting with the
  policy, async mode, no learner) over K times one collector's, for K = 1 .. cores.
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
from common.collectors import (  # noqa: E402
    Collectors,
    available_cores,
    default_learner_threads,
)
from common.control import CHUNKS_DONE, FINISHED  # noqa: E402
from common.replay import ReplayBuffer, to_device  # noqa: E402
from common.weights import WeightSync  # noqa: E402


@dataclass
class Bench:
    env: str = "Humanoid-v5"
    """gymnasium id"""
    quick: bool = False
    """short runs, one repeat (about two minutes on 2 cores)"""
    repeats: int | None = None
    """repeats per figure; the median is reported (default 3, 1 with --quick)"""
    out: str = "benchmarks/throughput.json"
    """where the JSON goes"""
    scaling_only: bool = False
    """only collector_scaling (for a many-core machine)"""
    max_collectors: int | None = None
    """largest K for collector_scaling (default: the cores)"""
    collectors: list[int] | None = None
    """the K values of collector_scaling (default 1 .. --max-collectors; 1 is always run,
    as the reference)"""
    steps_per_collector: int | None = None
    """env steps per collector in collector_scaling (default 4800, 1280 with --quick)"""
    compile: bool | None = None
    """--compile and --amp of every learner here, in the runs and alone (default: fast_sac.py's
    default for a long run on this machine; a short run alone would resolve them otherwise)"""
    run_steps: int | None = None
    """env steps of each training run, a quarter of them before learning starts (default
    40,000, 8,000 with --quick)"""


def bare_env_steps_per_s(env_id: str, num_envs: int, seconds: float, actor=None) -> float:
    """One process stepping a vector env with random actions (or `actor`'s, acting
    included)."""
    torch.set_num_threads(1)  # as a collector does
    envs = fast_sac.make_env(env_id, num_envs)
    obs, _ = envs.reset(seed=0)
    rng = np.random.default_rng(0)
    low, high = envs.single_action_space.low, envs.single_action_space.high
    shape = (num_envs, *low.shape)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if actor is None:
            action = rng.uniform(low, high, size=shape).astype(np.float32)
        else:
            action = actor.act(torch.from_numpy(obs).float()).numpy()
        obs, *_ = envs.step(action)
        steps += num_envs
    rate = steps / (time.perf_counter() - t0)
    envs.close()
    return rate


def full_run(env_id: str, total: int, learning_starts: int, fast: bool, *flags: str) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, os.path.join(ROOT, "fast_sac.py"), "--env", env_id, "--device",
               "cpu", "--total-timesteps", str(total), "--learning-starts",
               str(learning_starts), "--compile", str(fast), "--amp", str(fast),
               "--eval-interval", "0", "--eval-episodes", "1",
               "--run-dir", run_dir, "--log-interval", "1000", *flags]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)


def isolated_updates_per_s(env_id: str, iterations: int, threads: int, fast: bool) -> float:
    args = fast_sac.resolve_args(fast_sac.Args(env=env_id, device="cpu", compile=fast, amp=fast))
    torch.set_num_threads(threads)  # as the learner does
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
            learner.train_iteration(to_device(batch, "cpu"))
            ws.publish(learner.actor, version)

        iteration(0)
        t0 = time.perf_counter()
        for i in range(iterations):
            iteration(i + 1)
        return iterations * args.updates_per_iter / (time.perf_counter() - t0)
    finally:
        rb.close(), rb.unlink(), ws.close(), ws.unlink()


def collectors_steps_per_s(env_id: str, k: int, envs_each: int, total_per_collector: int,
                           run_dir: str) -> float:
    """K real collector processes in async mode with the policy acting and no learner;
    env steps/s from the moment every one has finished its first chunk to the end."""
    # (rings of 2048 rows: enough for the async window, and at K = 14 with Humanoid a third
    # of a GB of /dev/shm rather than the 8 GB that 200,000 rows per collector took)
    args = fast_sac.resolve_args(fast_sac.Args(
        env=env_id, device="cpu", num_envs=k * envs_each, num_collectors=k, sync_mode="async",
        learning_starts=0, total_timesteps=total_per_collector * k,
        buffer_size=2048 * k * envs_each))
    obs_dim, act_dim, low, high = fast_sac.env_dims(args.env)
    collectors = Collectors.create("throughput", args, run_dir,
                                   fast_sac.make_actor(args, obs_dim, act_dim, low, high),
                                   obs_dim, act_dim)
    ctrl = collectors.ctrl
    try:
        collectors.ws.publish(fast_sac.make_actor(args, obs_dim, act_dim, low, high), 0)
        collectors.start(fast_sac.make_env, fast_sac.Explorer, [None] * k)
        # no learner samples here, so this loop moves the read position that async
        # collectors keep within reach of (async_window_chunks) along with them: without
        # it they would wait at the window's edge for a learner that is not there
        def reached(condition):
            collectors.wait_until(lambda: collectors.reading(ctrl.slowest()) or condition())

        reached(lambda: ctrl.slowest() >= 1)
        t0, first = time.perf_counter(), int(ctrl.all_counters[:, CHUNKS_DONE].sum())
        reached(lambda: all(ctrl.row(i).state == FINISHED for i in range(k)))
        chunks = int(ctrl.all_counters[:, CHUNKS_DONE].sum()) - first
        return chunks * envs_each * args.steps_per_iter / (time.perf_counter() - t0)
    finally:
        collectors.close()


def write_scaling(path: str, env_id: str, cores: int, rows: dict[str, list[float]],
                  k: int) -> None:
    """collector_scaling so far (the K values measured yet) as JSON; a line for K = `k`."""
    med = {key: float(np.median(v)) for key, v in rows.items() if v}
    ks = [int(key.split("_")[1].split("/")[0]) for key in med]
    one = med["collectors_1/steps_per_s"]  # (K = 1 runs first)
    scaling = {n: med[f"collectors_{n}/steps_per_s"] / (n * one) for n in ks}
    print(f"K={k:2d}: {med[f'collectors_{k}/steps_per_s']:9.0f} env steps/s, collector_scaling "
          f"{scaling[k]:.3f}", flush=True)
    with open(path, "w") as f:
        json.dump({"env": env_id, "cores": cores, "medians": med, "collector_scaling": scaling},
                  f, indent=2)


def main(b: Bench) -> None:
    env_id = fast_sac.resolve_env_id(b.env)
    args = fast_sac.resolve_args(fast_sac.Args(env=env_id, device="cpu"))  # (a long run's)
    fast = args.compile if b.compile is None else b.compile
    cores = available_cores()
    repeats = b.repeats or (1 if b.quick else 3)
    seconds, total, iters = (4, 8_000, 10) if b.quick else (15, 40_000, 60)
    total = b.run_steps or total
    starts = total // 4
    threads = {"default": default_learner_threads(1), "shared": cores}
    rows: dict[str, list[float]] = {"bare_env_steps_per_s": [], "bare_policy_env_steps_per_s": []}
    obs_dim, act_dim, low, high = fast_sac.env_dims(env_id)
    actor = fast_sac.make_actor(args, obs_dim, act_dim, low, high)
    for name in threads:
        for key in ("collector_steps_per_s", "run_updates_per_s", "isolated_updates_per_s",
                    "collect_s_per_iter"):
            rows[f"{name}/{key}"] = []
    for key in ("lockstep_updates_per_s", "pipelined_updates_per_s"):
        rows[f"overlap/{key}"] = []
    ks = sorted({1, *(b.collectors or range(1, (b.max_collectors or cores) + 1))})
    rows["collector_alone_steps_per_s"] = []
    for k in ks:
        rows[f"collectors_{k}/steps_per_s"] = []

    if b.scaling_only:
        rows = {k: v for k, v in rows.items() if k.startswith("collectors_")}
    per_collector = b.steps_per_collector or 4 * args.steps_per_iter * (40 if b.quick else 150)
    for _ in range(repeats):
        if b.scaling_only:
            with tempfile.TemporaryDirectory() as run_dir:
                for k in ks:
                    rows[f"collectors_{k}/steps_per_s"].append(collectors_steps_per_s(
                        env_id, k, 4, per_collector, run_dir))
                    write_scaling(b.out, env_id, cores, rows, k)  # (as it goes)
            continue
        rows["bare_env_steps_per_s"].append(bare_env_steps_per_s(env_id, args.num_envs, seconds))
        rows["bare_policy_env_steps_per_s"].append(
            bare_env_steps_per_s(env_id, args.num_envs, seconds, actor=actor))
        with tempfile.TemporaryDirectory() as run_dir:
            rows["collector_alone_steps_per_s"].append(collectors_steps_per_s(
                env_id, 1, args.num_envs, args.num_envs * args.steps_per_iter
                * (40 if b.quick else 150), run_dir))
        for name, n in threads.items():
            s = full_run(env_id, total, starts, fast, "--learner-threads", str(n))
            perf = s["perf"]
            rows[f"{name}/collector_steps_per_s"].append(perf["collector_steps_per_s"])
            rows[f"{name}/run_updates_per_s"].append(perf["updates_per_s_since_first_update"])
            rows[f"{name}/collect_s_per_iter"].append(perf["collect_s"] / s["iterations"])
            rows[f"{name}/isolated_updates_per_s"].append(
                isolated_updates_per_s(env_id, iters, n, fast))
        # overlap: as many updates per iteration as take the time of collecting one chunk
        collect = float(np.median(rows["default/collect_s_per_iter"]))
        update = 1.0 / float(np.median(rows["default/isolated_updates_per_s"]))
        balanced = max(1, round(collect / update))
        for mode in ("lockstep", "pipelined"):
            perf = full_run(env_id, total, starts, fast,
                            "--learner-threads", str(threads["default"]),
                            "--updates-per-iter", str(balanced), "--sync-mode", mode)["perf"]
            rows[f"overlap/{mode}_updates_per_s"].append(perf["updates_per_s_since_first_update"])
        with tempfile.TemporaryDirectory() as run_dir:
            for k in ks:
                rows[f"collectors_{k}/steps_per_s"].append(collectors_steps_per_s(
                    env_id, k, 4, per_collector, run_dir))
    med = {k: float(np.median(v)) for k, v in rows.items()}
    scaling = {k: med[f"collectors_{k}/steps_per_s"] / (k * med["collectors_1/steps_per_s"])
               for k in ks}
    if b.scaling_only:  # (printed and written as it went)
        return
    result = {
        "env": env_id, "num_envs": args.num_envs, "repeats": repeats, "quick": b.quick,
        "compile_and_amp": fast,
        "cores": cores, "learner_threads": threads, "overlap_updates_per_iter": balanced,
        "medians": med, "runs": rows,
        **{f"collector_efficiency/{name}": med[f"{name}/collector_steps_per_s"]
           / med["bare_env_steps_per_s"] for name in threads},
        "collector_gap/policy_over_random": med["bare_policy_env_steps_per_s"]
        / med["bare_env_steps_per_s"],
        "collector_gap/plumbing": med["collector_alone_steps_per_s"]
        / med["bare_policy_env_steps_per_s"],
        **{f"collector_gap/in_run_over_alone/{name}": med[f"{name}/collector_steps_per_s"]
           / med["collector_alone_steps_per_s"] for name in threads},
        **{f"learner_efficiency/{name}": med[f"{name}/run_updates_per_s"]
           / med[f"{name}/isolated_updates_per_s"] for name in threads},
        "overlap": med["overlap/pipelined_updates_per_s"] / med["overlap/lockstep_updates_per_s"],
        "collector_scaling": scaling,
    }
    print(f"{env_id}, {cores} cores, learner threads {threads}, --compile and --amp {fast}, "
          f"{repeats} repeat(s); overlap at --updates-per-iter {balanced}")
    print(f"{'figure':40s} {'median':>10s}   runs")
    for k, v in rows.items():
        print(f"{k:40s} {med[k]:10.3f}   {', '.join(f'{x:.3f}' for x in v)}")
    for key, value in result.items():
        if key.startswith(("collector_", "learner_", "overlap")) and value and \
                not isinstance(value, dict):
            print(f"{key:40s} {value:10.3f}")
    for k, v in result["collector_scaling"].items():
        print(f"{f'collector_scaling (K={k})':40s} {v:10.3f}")
    with open(b.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Bench))
