"""Time to produce one learner iteration's sample, on the learner's device, per data path.

    python benchmarks/sample_time.py --device cpu     # host gather vs the mirror on the CPU
    python benchmarks/sample_time.py --device cuda    # host gather + copy vs the GPU mirror

A replay buffer of the GPU recipe's shape (Humanoid-v5: 32 envs, 1M rows, 348 + 17 dims)
is filled with random rows; each timed iteration then commits steps-per-iter new rows per
env (as the collectors would) and draws the GPU recipe's sample of batch x updates =
131,072 n-step rows:
  host           Sampler: np.take on the host, then a copy to the device (pinned on CUDA)
  obs_gather_Nt  the host gather of obs and next_obs alone, split across N threads (to
                 see whether splitting pays)
  mirror         Mirror: copies the new rows to the device, gathers there
Prints the median milliseconds of each and writes JSON, rewritten after each data path.
Copied next to an older checkout's common/ it times that checkout's host path (the "before"
figure in issue 11's note).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import replay  # noqa: E402


@dataclass
class Bench:
    env: str = "Humanoid-v5"
    """env whose observation and action sizes the buffer takes"""
    device: str = "cuda"
    """cuda or cpu (where the learner would be)"""
    num_envs: int = 32
    buffer_size: int = 1_000_000
    rows: int = 131_072
    """rows per sample (the GPU recipe: batch 4096 x 32 updates)"""
    steps_per_iter: int = 8
    n_step: int = 3
    iterations: int = 10
    """timed samples per data path; the median is reported"""
    threads: int = 1
    """torch CPU threads (the CPU learner's default on 2 cores is 1)"""
    gather_threads: list[int] = field(default_factory=lambda: [1, 2])
    """thread counts of the obs_gather variant"""
    out: str = "benchmarks/sample_time.json"


def split_gather(rb, pool, threads: int, rng, b: Bench, written: int, out) -> None:
    """The host gather of obs and next_obs, split into `threads` parts gathered at once."""
    flat = rb.draw(rng, b.rows, b.n_step, written, b.steps_per_iter)
    parts = np.array_split(np.arange(b.rows), threads)

    def gather(part):
        for k, values in enumerate((rb.obs, rb.next_obs)):
            flat_field = values.reshape(rb.num_envs * rb.capacity, -1)
            np.take(flat_field, flat[part, k * (b.n_step - 1)], axis=0, out=out[k, part[0]:
                    part[-1] + 1], mode="clip")

    list(pool.map(gather, parts))


def main(b: Bench) -> dict:
    torch.set_num_threads(b.threads)
    device = torch.device(b.device)
    env = gym.make(b.env)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    env.close()
    capacity = b.buffer_size // b.num_envs
    rb = replay.ReplayBuffer.create(b.num_envs, capacity, obs_dim, act_dim)
    try:
        fill = np.random.default_rng(0)
        for key in replay.FIELDS:  # (random rows; dones about every 200 steps)
            values = getattr(rb, key)
            values[:] = (fill.random(values.shape, np.float32) < 0.005 if key in ("dones",
                        "terminated") else fill.standard_normal(values.shape, np.float32))
        written = capacity
        rb.commit(slice(None), written)
        if hasattr(replay, "Sampler"):
            paths = {"host": replay.Sampler(rb, np.random.default_rng(1), device, b.rows,
                                            b.n_step, 0.99, pinned=device.type == "cuda")}
        else:  # (a checkout from before Sampler moved to common/replay.py, CPU only)
            rng = np.random.default_rng(1)
            paths = {"host": lambda w, window, floor: {
                k: torch.from_numpy(v) for k, v in rb.sample(rng, b.rows, b.n_step, 0.99, w,
                                                              window, floor).items()}}
        if hasattr(replay, "Mirror"):
            paths["mirror"] = replay.Mirror(rb, np.random.default_rng(1), device, b.rows,
                                            b.n_step, 0.99)
            paths["mirror"](written, b.steps_per_iter, 0)  # the first call copies everything
        out = np.empty((2, b.rows, obs_dim), np.float32)
        for n in b.gather_threads if hasattr(rb, "draw") else ():
            pool, rng = ThreadPoolExecutor(n), np.random.default_rng(1)
            paths[f"obs_gather_{n}t"] = (lambda w, window, floor, pool=pool, rng=rng, n=n:
                                         split_gather(rb, pool, n, rng, b, w, out))
        result = {"device": str(device), "rows": b.rows, "obs_dim": obs_dim,
                  "torch_threads": b.threads, "replay_module": replay.__file__}
        for name, sample in paths.items():
            times = []
            for _ in range(b.iterations + 1):  # (the first one is a warm-up)
                written += b.steps_per_iter  # the collectors' new rows (same contents)
                rb.commit(slice(None), written)
                t0 = time.perf_counter()
                sample(written, b.steps_per_iter, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            result[f"{name}_ms"] = round(1000 * float(np.median(times[1:])), 2)
            print(f"{name}: {result[f'{name}_ms']} ms", flush=True)
            with open(b.out, "w") as f:  # (as it goes)
                json.dump(result, f, indent=1)
    finally:
        rb.close()
        rb.unlink()
    return result


if __name__ == "__main__":
    main(tyro.cli(Bench))
