"""--cudagraphs on a CPU: common/graph.py's StandIn records one learner iteration's ops and
replays them on the same tensors, as a CUDA graph does, so these tests catch here what would
go wrong on a GPU: a replay that trains on a stale batch, a capture that outlives a resume,
warm-ups that are not undone, the actor's turn (policy_frequency) fixed at capture."""

import copy
import types

import numpy as np
import pytest
import torch
from conftest import SMALL, run_script, script_file, script_module

from common.graph import IterationGraph


def make(mod, seed: int):
    args = mod.resolve_args(mod.Args(env="Pendulum", device="cpu", critic_hidden=32,
                                     actor_hidden=32, num_atoms=11, batch_size=16,
                                     updates_per_iter=3, policy_frequency=2, compile=False,
                                     amp=False), check_shm=False)
    torch.manual_seed(seed)
    return args, mod.Learner(args, 3, 1, np.array([-2.0], np.float32),
                             np.array([2.0], np.float32), torch.device("cpu"))


def batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"obs": torch.randn(48, 3, generator=g), "next_obs": torch.randn(48, 3, generator=g),
             "actions": torch.rand(48, 1, generator=g) * 4 - 2,
             "rewards": torch.randn(48, generator=g), "discounts": torch.full((48,), 0.9)}
            for _ in range(n)]


@pytest.mark.parametrize("script", ["fast_sac.py", "fast_td3.py"])
def test_graph_replay_equals_the_plain_updates_bit_for_bit(script):
    """The same learner trained on the same batches, plainly and through the graph
    (train_step with a StandIn): equal parameters, optimizer moments and metrics after every
    iteration, bit for bit. The batches differ every iteration (a replay that missed the
    copy into the graph's inputs would train on the first again), 3 updates an iteration
    with the actor every 2nd (two graphs, one per turn), and after 3 iterations both load
    another learner's state, as a resume does (its optimizers' moments are new tensors: a
    capture kept from before would go on updating the old ones)."""
    mod = script_module(script)
    args, plain = make(mod, 0)
    _, graphed = make(mod, 0)
    _, other = make(mod, 7)
    other.train_iteration(batches(1, 99)[0])
    state = mod.learner_state(other)
    run = types.SimpleNamespace(learner=graphed, args=args, graph=IterationGraph(
        lambda b: mod.graphed_iteration(graphed, b), graphed, graphed.STATE,
        torch.device("cpu")))
    data = batches(6, 1)
    for learner in (plain, graphed):
        torch.manual_seed(5)  # (the same noise for both: a replay draws what eager draws)
        results = []
        for i, batch in enumerate(data):
            if i == 3:
                mod.load_learner(learner, copy.deepcopy(state))  # (as torch.load gives)
            metrics = (mod.train_step(run, batch) if learner is graphed
                       else learner.train_iteration(batch))
            results.append(({k: v.clone() for k, v in metrics.items()},
                            [t.clone() for t in tensors(learner)], learner.num_updates))
        learner.results = results
    assert run.graph is not None and len(run.graph.graphs) == 2  # (went on as a graph)
    for (m1, t1, n1), (m2, t2, n2) in zip(plain.results, graphed.results):
        assert n1 == n2
        assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)
        assert len(t1) == len(t2) and all(torch.equal(a, b) for a, b in zip(t1, t2))


def tensors(learner) -> list[torch.Tensor]:
    """Parameters, buffers, optimizer moments and step counts: what an update changes."""
    from common.graph import held_tensors

    return held_tensors(learner, learner.STATE)


@pytest.mark.slow
@pytest.mark.script("fast_sac.py")
def test_a_run_with_cudagraphs_on_a_cpu_ends_as_the_eager_run(tmp_path, no_shm_leak):
    """fast_sac.py --cudagraphs with --compile False on a CPU (the stand-in) in lockstep ends
    with the same parameters as the same run without it."""
    finals = []
    for flags in ([], ["--cudagraphs"]):
        run_dir = str(tmp_path / f"run{len(flags)}")
        res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "800", "--sync-mode",
                         "lockstep", "--run-dir", run_dir, *flags)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "cudagraphs failed" not in res.stderr
        finals.append(torch.load(f"{run_dir}/model_final.pt", weights_only=False))
    for key in ("actor", "critics"):
        for name, t in finals[0][key].items():
            assert torch.equal(t, finals[1][key][name]), (key, name)


@pytest.mark.slow
@pytest.mark.script("fast_sac_multigpu.py")
def test_two_ranks_with_cudagraphs_on_a_cpu_end_equal(tmp_path, no_shm_leak):
    """fast_sac_multigpu.py --cudagraphs under torchrun with two gloo ranks on the CPU: the
    stand-in replays the gradient all-reduce with the rest, the ranks end with identical
    parameters, and those of the same run without --cudagraphs."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    hashes = []
    for flags in ([], ["--cudagraphs"]):
        run_dir = str(tmp_path / f"run{len(flags)}")
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node", "2",
                              os.path.join(ROOT, script_file("fast_sac_multigpu.py")), *SMALL,
                              "--total-timesteps", "800", "--sync-mode", "lockstep",
                              "--run-dir", run_dir, *flags], cwd=ROOT, capture_output=True,
                             text=True, timeout=300,
                             env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
        assert res.returncode == 0, res.stderr[-4000:]
        assert "cudagraphs failed" not in res.stderr
        with open(os.path.join(run_dir, "summary.json")) as f:
            s = json.load(f)
        assert s["status"] == "completed" and s["num_updates"] > 0 and s["world_size"] == 2
        hashes += s["rank_param_hashes"]
    assert len(set(hashes)) == 1, hashes
