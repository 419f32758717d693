"""Learner iteration time of fast_sac_multigpu.py for 1 vs N ranks at the same per-rank batch.

    python benchmarks/dist_iteration.py --nprocs 2            # CPU: gloo, 1 thread per rank
    python benchmarks/dist_iteration.py --nprocs 1 --device cuda

Launches torchrun with 1 and with --nprocs processes. Each rank times `train_iteration` on a
fixed batch (updates_per_iter mini-batches of --batch-size) and, separately, the flat
gradient all-reduce of the critics and of the actor. Prints medians and writes JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass
class Bench:
    nprocs: int = 2
    """ranks to compare against one"""
    env: str = "Humanoid-v5"
    """env whose observation and action sizes the networks take"""
    device: str = "cpu"
    """cpu (gloo) or cuda (nccl)"""
    batch_size: int = 256
    """per-rank batch"""
    critic_hidden: int = 256
    actor_hidden: int = 256
    updates_per_iter: int = 16
    iterations: int = 10
    """timed iterations (after one warm-up)"""
    bf16: bool = False
    """run the updates under bf16 autocast (CUDA only)"""
    out: str = "benchmarks/dist_iteration.json"
    worker: bool = False
    """internal: this process is a torchrun worker"""


def worker(b: Bench) -> None:
    import fast_sac_multigpu as m
    from common import dist as D

    torch.set_num_threads(1)
    info = D.init("auto", b.device)
    args = m.resolve_args(m.Args(env=b.env, device=b.device, batch_size=b.batch_size,
                                 critic_hidden=b.critic_hidden, actor_hidden=b.actor_hidden,
                                 updates_per_iter=b.updates_per_iter, compile=False,
                                 amp=b.bf16), check_shm=False)  # (no buffer is created)
    obs_dim, act_dim, low, high = m.env_dims(args.env)
    dev = torch.device(info.device)
    learner = m.Learner(args, obs_dim, act_dim, low, high, dev, info)
    n = b.batch_size * b.updates_per_iter
    g = torch.Generator().manual_seed(info.rank)
    batch = {"obs": torch.randn(n, obs_dim, generator=g),
             "next_obs": torch.randn(n, obs_dim, generator=g),
             "actions": torch.rand(n, act_dim, generator=g) * 2 - 1,
             "rewards": torch.randn(n, generator=g), "discounts": torch.full((n,), 0.97)}
    batch = {k: v.to(dev) for k, v in batch.items()}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn, reps):
        fn()
        sync()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
        return float(np.median(out))

    iteration_s = timed(lambda: learner.train_iteration(batch), b.iterations)  # (--bf16: amp)
    params = list(learner.critics.parameters()) + list(learner.actor.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    allreduce_s = timed(lambda: (D.allreduce_grads_(learner.critics.parameters(), info),
                                 D.allreduce_grads_(learner.actor.parameters(), info)), 50)
    res = D.gather_strings(json.dumps({"iteration_s": iteration_s, "allreduce_s": allreduce_s}),
                           info)
    if info.rank == 0:
        print("RESULT " + json.dumps([json.loads(r) for r in res]), flush=True)
    D.shutdown(info)


def launch(b: Bench, nprocs: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nprocs), os.path.abspath(__file__), "--worker", "--env", b.env, "--device",
           b.device, "--batch-size", str(b.batch_size), "--critic-hidden",
           str(b.critic_hidden), "--actor-hidden", str(b.actor_hidden), "--updates-per-iter",
           str(b.updates_per_iter), "--iterations", str(b.iterations)]
    if b.bf16:
        cmd.append("--bf16")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(b: Bench) -> None:
    if b.worker:
        return worker(b)
    results = {}
    for n in sorted({1, b.nprocs}):
        ranks = launch(b, n)
        it = max(r["iteration_s"] for r in ranks)  # the slowest rank sets the pace
        ar = max(r["allreduce_s"] for r in ranks)
        updates = b.updates_per_iter
        results[n] = {"iteration_s": it, "updates_per_s_per_rank": updates / it,
                      "samples_per_s_total": n * updates * b.batch_size / it,
                      "allreduce_per_update_s": ar, "ranks": ranks}
        print(f"{n} rank(s): iteration {it * 1e3:8.1f} ms | {updates / it:7.1f} updates/s | "
              f"{n * updates * b.batch_size / it:9.0f} samples/s | all-reduce (critic+actor "
              f"grads) {ar * 1e3:6.2f} ms")
    if b.nprocs > 1:
        ratio = results[b.nprocs]["iteration_s"] / results[1]["iteration_s"]
        print(f"iteration time {b.nprocs} ranks / 1 rank: {ratio:.2f}")
    with open(b.out, "w") as f:
        json.dump({"bench": vars(b), "results": results}, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Bench))
