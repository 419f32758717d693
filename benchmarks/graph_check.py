"""Does --cudagraphs compute what the eager learner computes? The device check's first step.

    python benchmarks/graph_check.py --device cuda                # the GPU recipe's shapes
    python benchmarks/graph_check.py --device cpu --dry-run       # tiny shapes, the stand-in

From one learner state, N iterations on N different batches are run four ways: eager, eager
again, through the graph (train_step, as a run replays it) and eager on the first batch N
times (what a replay that missed the copy into the graph's inputs would train on). For each
way it compares the parameters with the first eager run's, as the largest difference over
the largest change the N iterations made (so 0 is the same, 1 is as far as training moved),
and the last iteration's losses.

Tolerance: on a GPU two eager runs already differ (atomic adds in scatter_add_ and in the
backward of indexing run in any order, and bf16 rounds each difference up), so the graph is
held to the noise of eager itself: at most max(3 x the eager-vs-eager difference, 0.01). The
stale-batch run must land far outside it (more than 3x the graph's difference, and above
the tolerance): that shows the comparison would catch a stale batch. On a CPU (float32, the
stand-in) every difference but the stale run's must be exactly 0.
Writes its result as JSON (--out) and exits non-zero if the graph does not pass.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import types
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.graph import IterationGraph, held_tensors  # noqa: E402


@dataclass
class Check:
    script: str = "fast_sac"
    """fast_sac or fast_td3"""
    device: str = "cuda"
    """cuda or cpu"""
    iterations: int = 5
    """iterations compared"""
    dry_run: bool = False
    """tiny shapes (batch 32, width 32, 2 updates an iteration), float32"""
    out: str = "graph_check.json"
    """where the JSON goes"""


def run(b: Check, mod, args, state, batches, graph: bool):
    """The learner from `state`, trained on `batches` (seeded alike); its tensors, losses."""
    obs_dim, act_dim, low, high = mod.env_dims(args.env)
    learner = mod.Learner(args, obs_dim, act_dim, low, high, torch.device(b.device))
    mod.load_learner(learner, copy.deepcopy(state))
    loop = types.SimpleNamespace(learner=learner, args=args, graph=IterationGraph(
        lambda x: mod.graphed_iteration(learner, x), learner, learner.STATE,
        torch.device(b.device)) if graph else None)
    torch.manual_seed(5)
    if b.device == "cuda":
        torch.cuda.manual_seed(5)
    for batch in batches:
        metrics = mod.train_step(loop, batch)
    if graph and loop.graph is None:
        raise SystemExit("the capture failed (see the warning above)")
    return weights(learner), {k: float(v) for k, v in metrics.items()}


def main(b: Check) -> int:
    mod = importlib.import_module(b.script)
    sizes = (dict(batch_size=32, actor_hidden=32, critic_hidden=32, updates_per_iter=2,
                  compile=False, amp=False) if b.dry_run else {})
    args = mod.resolve_args(mod.Args(env="Humanoid-v5", device=b.device, prefetch=False,
                                     **sizes), check_shm=False)
    args.compile = False if b.device == "cpu" else args.compile  # (the CPU stand-in: eager)
    obs_dim, act_dim, low, high = mod.env_dims(args.env)
    torch.manual_seed(0)
    start = mod.learner_state(mod.Learner(args, obs_dim, act_dim, low, high,
                                          torch.device(b.device)))
    n = args.batch_size * args.updates_per_iter
    g = torch.Generator(device=b.device).manual_seed(1)
    batches = [{"obs": torch.randn(n, obs_dim, device=b.device, generator=g),
                "next_obs": torch.randn(n, obs_dim, device=b.device, generator=g),
                "actions": torch.rand(n, act_dim, device=b.device, generator=g) * 0.8 - 0.4,
                "rewards": torch.randn(n, device=b.device, generator=g),
                "discounts": torch.full((n,), 0.97, device=b.device)}
               for _ in range(b.iterations)]
    ways = {"eager": (batches, False), "eager_again": (batches, False),
            "graph": (batches, True), "stale_batch": ([batches[0]] * b.iterations, False)}
    results = {k: run(b, mod, args, start, data, graph) for k, (data, graph) in ways.items()}
    base, base_losses = results["eager"]
    moved = max(float((t - t0).abs().max()) for t, t0 in zip(base, initial(mod, args, start, b)))
    diff = {k: max(float((t - u).abs().max()) for t, u in zip(p, base)) / moved
            for k, (p, _) in results.items() if k != "eager"}
    tolerance = max(3 * diff["eager_again"], 0.01) if b.device == "cuda" else 0.0
    ok = (diff["graph"] <= tolerance and diff["stale_batch"] > max(3 * diff["graph"], tolerance))
    out = {"device": torch.cuda.get_device_name() if b.device == "cuda" else "cpu",
           "torch": torch.__version__, "script": b.script, "iterations": b.iterations,
           "recipe": {k: getattr(args, k) for k in ("batch_size", "updates_per_iter",
                                                    "actor_hidden", "critic_hidden",
                                                    "compile", "amp")},
           "largest_change": moved, "difference_over_change": diff, "tolerance": tolerance,
           "losses": {k: v[1] for k, v in results.items()}, "graph_equals_eager": ok}
    print(json.dumps(out, indent=1))
    with open(b.out, "w") as f:
        json.dump(out, f, indent=2)
    print("graph_equals_eager:", "PASS" if ok else "FAIL", f"(graph {diff['graph']:.2e}, eager "
          f"again {diff['eager_again']:.2e}, stale batch {diff['stale_batch']:.2e}, tolerance "
          f"{tolerance:.2e})")
    return 0 if ok else 1


def initial(mod, args, state, b: Check) -> list[torch.Tensor]:
    """weights() of a learner loaded from `state`, before any update."""
    obs_dim, act_dim, low, high = mod.env_dims(args.env)
    learner = mod.Learner(args, obs_dim, act_dim, low, high, torch.device(b.device))
    mod.load_learner(learner, copy.deepcopy(state))
    return weights(learner)


def weights(learner) -> list[torch.Tensor]:
    """The networks' parameters and buffers and the learner's own tensors (not the
    optimizers' moments), as float32 copies."""
    return [t.detach().float().clone()
            for t in held_tensors(learner, learner.STATE, moments=False)]


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Check)))
