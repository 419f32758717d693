import copy
import dataclasses
import math
import multiprocessing as mp
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ORIGINALS, ROOT, script_file, script_module
from torch.utils._python_dispatch import TorchDispatchMode

from common.collectors import check_mirror_fits, collector_main, env_slice
from common.control import FINISHED, Control
from common.replay import ReplayBuffer
from common.weights import WeightSync

fs = script_module("fast_sac.py")
pytestmark = pytest.mark.script("fast_sac.py")  # (but for those parametrized by `script`)


def brute_force_projection(probs, rewards, discounts, support):
    """Distribute each atom's mass to its two neighbours by linear interpolation."""
    v_min, v_max, n = support[0], support[-1], len(support)
    dz = (v_max - v_min) / (n - 1)
    out = np.zeros_like(probs)
    for i in range(probs.shape[0]):
        for j in range(n):
            tz = min(max(rewards[i] + discounts[i] * support[j], v_min), v_max)
            b = (tz - v_min) / dz
            lo = int(math.floor(b + 1e-9))
            frac = b - lo
            if lo >= n - 1:
                out[i, n - 1] += probs[i, j]
            else:
                out[i, lo] += probs[i, j] * (1 - frac)
                out[i, lo + 1] += probs[i, j] * frac
    return out


@pytest.mark.algorithm
def test_c51_projection_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    support = torch.linspace(-10, 10, 21, dtype=torch.float64)
    probs = torch.rand(64, 21, generator=g, dtype=torch.float64).softmax(-1)
    rewards = torch.randn(64, generator=g, dtype=torch.float64) * 6
    rewards[:4] = torch.tensor([0.0, 1.0, -30.0, 30.0])  # exact atom hits and clipping
    discounts = torch.rand(64, generator=g, dtype=torch.float64)
    discounts[:2] = 1.0
    discounts[4] = 0.0  # terminal: all mass on the reward
    got = fs.project(probs, rewards, discounts, support).numpy()
    want = brute_force_projection(probs.numpy(), rewards.numpy(), discounts.numpy(),
                                  support.numpy())
    np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(got.sum(1), 1.0)


@pytest.mark.algorithm
def test_c51_projection_puts_mass_at_v_max_on_the_last_atom_despite_rounding():
    """In float32, (v_max - v_min) / delta is 100.0000076 on this support of 101 atoms, so a
    target clamped to v_max once pointed one atom past the end (an index error in eager
    mode, a write out of bounds compiled)."""
    support = torch.linspace(-10.0, 200.0, 101)
    assert ((support[-1] - support[0]) / ((support[-1] - support[0]) / 100)).ceil() == 101
    probs = torch.rand(8, 101, generator=torch.Generator().manual_seed(0)).softmax(-1)
    rewards, discounts = torch.full((8,), 50.0), torch.full((8,), 0.99)
    got = fs.project(probs, rewards, discounts, support).numpy()
    want = brute_force_projection(probs.double().numpy(), rewards.double().numpy(),
                                  discounts.double().numpy(), support.double().numpy())
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got.sum(1), 1.0, rtol=1e-5)


def test_normalizer_matches_numpy_over_chunks():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 5)).astype(np.float32)
    norm = fs.Normalizer(5)
    for part in np.array_split(x, 7):
        norm.update(torch.from_numpy(part))
    np.testing.assert_allclose(norm.mean.numpy(), x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.var.numpy(), x.var(0), rtol=1e-4)
    assert norm.count.item() == 1000


@pytest.mark.algorithm
def test_actor_log_prob_matches_change_of_variables():
    torch.manual_seed(0)
    low, high = np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32)
    actor = fs.Actor(3, 2, 32, low, high, -5.0, 1.0)
    x = torch.randn(4000, 3)
    eps = torch.randn(4000, 2, generator=torch.Generator().manual_seed(1))
    action, log_prob = actor.sample(x, eps)
    assert (action >= torch.tensor(low)).all() and (action <= torch.tensor(high)).all()
    # recompute from the action: N(u; mu, std) / |d action / d u|
    mu, log_std = actor(x)
    y = (action - actor.bias) / actor.scale
    u = torch.atanh(y.clamp(-0.999999, 0.999999))
    ref = (torch.distributions.Normal(mu, log_std.exp()).log_prob(u)
           - torch.log(actor.scale * (1 - y.square()) + 1e-6)).sum(-1)
    ok = y.abs().max(-1).values < 0.99  # atanh is ill-conditioned at the bounds
    torch.testing.assert_close(log_prob[ok], ref[ok], atol=2e-3, rtol=1e-3)


def test_env_name_resolution_and_suggestions():
    assert fs.resolve_env_id("Humanoid") == "Humanoid-v5"
    assert fs.resolve_env_id("HalfCheetah") == "HalfCheetah-v5"
    assert fs.resolve_env_id("Hopper-v4") == "Hopper-v4"
    with pytest.raises(fs.ArgsError, match="HalfCheetah"):
        fs.resolve_env_id("HalfCheeta")


@pytest.mark.parametrize("changes, message", [
    (dict(env="CartPole-v1"), "Discrete action space"),
    (dict(batch_size=0), "--batch-size must be positive"),
    (dict(num_envs=-1), "--num-envs must be positive"),
    (dict(buffer_size=1000, batch_size=2000, num_envs=2), "raise --buffer-size"),
    (dict(learning_starts=10_000, total_timesteps=5_000), "--learning-starts"),
    (dict(v_min=5.0, v_max=1.0), "--v-min"),
    (dict(env="Reacher", v_max=0.0), "give both --v-min and --v-max, or neither"),
    (dict(buffer_size=10**10), "shared memory but /dev/shm has only"),
])
def test_bad_arguments_are_rejected(changes, message):
    args = dataclasses.replace(fs.Args(env="Pendulum", device="cpu"), **changes)
    with pytest.raises(fs.ArgsError, match=message):
        fs.resolve_args(args)


def test_recipe_defaults_fill_only_unset_fields():
    args = fs.resolve_args(fs.Args(env="Pendulum", device="cpu", batch_size=64))
    assert args.batch_size == 64 and args.num_envs == fs.CPU_RECIPE["num_envs"]
    assert args.env == "Pendulum-v1" and (args.v_min, args.v_max) == fs.VALUE_RANGES["Pendulum"]


@pytest.mark.algorithm
@pytest.mark.parametrize("env, n_step, target_entropy, lr", [
    ("Hopper", 3, -0.5, 3e-4), ("Walker2d", 3, -0.5, 3e-4), ("Ant", 3, -0.5, 3e-4),
    ("HalfCheetah", 1, -0.5, 1e-3), ("Humanoid", 1, 0.42, 3e-4), ("Pendulum", 1, -0.5, 3e-4)])
def test_family_defaults_fill_n_step_target_entropy_and_lr_unless_given(env, n_step,
                                                                        target_entropy, lr):
    args = fs.resolve_args(fs.Args(env=env, device="cpu"))
    assert (args.n_step, args.target_entropy, args.actor_lr, args.critic_lr) == (
        n_step, target_entropy, lr, lr)
    args = fs.resolve_args(fs.Args(env=env, device="cpu", n_step=2, target_entropy=0.0,
                                   critic_lr=5e-4))
    assert (args.n_step, args.target_entropy, args.actor_lr, args.critic_lr) == (
        2, 0.0, lr, 5e-4)


@pytest.mark.algorithm
def test_support_of_an_env_the_table_lacks_follows_the_returns_seen():
    """Reacher is not in VALUE_RANGES: no --v-min/--v-max, and ReturnRange's support spans
    the lowest and highest discounted running return seen (and 0), with headroom."""
    args = fs.resolve_args(fs.Args(env="Reacher", device="cpu"))
    assert "Reacher" not in fs.VALUE_RANGES and args.v_min is None and args.v_max is None
    vr = fs.ReturnRange(num_envs=2, gamma=0.5)
    # env 0: rewards 4, 4 then an episode end, then -2; env 1: -1 every step
    vr.update(np.array([[4.0, 4.0, -2.0], [-1.0, -1.0, -1.0]]),
              np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # env 0: G = 4, 4 + 0.5 * 4 = 6, then -2 (a new episode); env 1: -1, -1.5, -1.75
    assert (vr.lo, vr.hi) == (-2.0, 6.0)
    assert np.allclose(vr.g, [-2.0, -1.75])
    assert vr.support() == (-2.0 - 8 / 4, 6.0 + 8 / 2)
    args = fs.dataclasses.replace(args, critic_hidden=16, num_atoms=11, actor_hidden=16)
    learner = fs.Learner(args, 3, 1, np.array([-1.0], np.float32), np.array([1.0], np.float32),
                         torch.device("cpu"))
    learner.set_support(*vr.changed_support())  # (what the loop does with it)
    for critics in (learner.critics, learner.critics_target):
        assert torch.allclose(critics.support, torch.linspace(-4.0, 10.0, 11))
    # handed to the critics once: rows inside the range change nothing to hand over again
    vr.update(np.array([[1.0], [1.0]]), np.zeros((2, 1)))
    assert vr.changed_support() is None
    vr.update(np.array([[9.0], [0.0]]), np.zeros((2, 1)))
    assert vr.changed_support() == vr.support() and vr.hi == 9.0  # (env 0: 9 + 0.5 * 0)
    positive = fs.ReturnRange(num_envs=1, gamma=0.9)
    positive.update(np.array([[1.0, 1.0]]), np.zeros((1, 2)))
    assert positive.lo == 0.0 and positive.support()[0] < 0  # 0 is always inside


@pytest.mark.parametrize("env_id, expect_terminations", [("Pendulum-v1", False),
                                                          ("InvertedPendulum-v5", True)])
def test_collector_stores_true_final_observation(env_id, expect_terminations, tmp_path,
                                                 no_shm_leak):
    """A real collector subprocess: transitions never span a reset; truncation is no
    termination."""
    args = fs.resolve_args(fs.Args(env=env_id, device="cpu", num_envs=2, steps_per_iter=50,
                                   total_timesteps=800, learning_starts=400,
                                   buffer_size=2000, sync_mode="lockstep",
                                   actor_hidden=32))
    obs_dim, act_dim, low, high = fs.env_dims(args.env)
    rb = ReplayBuffer.create(2, 1000, obs_dim, act_dim)
    ctrl = Control.create()
    actor = fs.Actor(obs_dim, act_dim, 32, low, high, -5.0, 1.0)
    ws = WeightSync.create(actor)
    proc = mp.get_context("spawn").Process(target=collector_main,
                                           args=(fs.make_env, fs.Explorer, args, 0, rb.spec,
                                                 ws.spec, ctrl.spec, str(tmp_path)))
    try:
        proc.start()
        for version in range(8):  # lockstep: one version per chunk
            ws.publish(actor, version)
            deadline = time.time() + 60
            while (ctrl.chunks_done <= version and time.time() < deadline
                   and proc.exitcode is None):
                time.sleep(0.01)
        proc.join(30)
        assert proc.exitcode == 0 and ctrl.state == FINISHED, ctrl.error_text()
        n = int(rb.written[0])
        assert n == 400
        dones, term = rb.dones[:, :n - 1], rb.terminated[:, :n - 1]
        continuing = np.abs(rb.next_obs[:, :n - 1] - rb.obs[:, 1:n]).max(-1) == 0
        # within an episode next_obs is the next row's obs; at an episode end it is not
        assert (continuing == (dones == 0)).all()
        assert dones.sum() > 0
        assert (term.sum() > 0) == expect_terminations
        if not expect_terminations:  # Pendulum only truncates, every 200 steps
            assert (term == 0).all() and dones[:, 199].all() and dones.sum() == 2
        count, episodes = ctrl.episodes_since(0)
        assert count == int(rb.dones[:, :n].sum())
        assert (episodes[:, 1] > 0).all()
        # ended by termination, not truncation (the last row's episode end counts too)
        assert episodes[:, 3].sum() == rb.terminated[:, :n].sum()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        for mem in (rb, ws, ctrl):
            mem.close()
            mem.unlink()


def test_target_update_keeps_targets_out_of_autograd():
    """Soft target updates must not record autograd history (it grew without bound)."""
    torch.manual_seed(0)
    args = fs.resolve_args(fs.Args(env="Pendulum", device="cpu", critic_hidden=32,
                                   actor_hidden=32, num_atoms=11, batch_size=16,
                                   updates_per_iter=2))
    learner = fs.Learner(args, 3, 1, np.array([-2.0], np.float32), np.array([2.0], np.float32),
                         torch.device("cpu"))
    before = [p.clone() for p in learner.critics_target.parameters()]
    batch = {"obs": torch.randn(32, 3), "next_obs": torch.randn(32, 3),
             "actions": torch.rand(32, 1) * 4 - 2, "rewards": torch.randn(32),
             "discounts": torch.full((32,), 0.9)}
    learner.train_iteration(batch)
    for old, p in zip(before, learner.critics_target.parameters()):
        assert p.grad_fn is None and not p.requires_grad and p.is_leaf
        assert not torch.equal(old, p)  # but they did move towards the online critics


@pytest.mark.script(*ORIGINALS)  # (common/'s alone)
def test_env_slices_partition_the_envs():
    for num_envs in (1, 5, 8, 32):
        for k in range(1, num_envs + 1):
            slices = [env_slice(num_envs, k, i) for i in range(k)]
            envs = [e for s in slices for e in range(num_envs)[s]]
            assert envs == list(range(num_envs))  # disjoint, in order, none missing
            sizes = [s.stop - s.start for s in slices]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.script(*ORIGINALS)  # (common/'s alone)
def test_control_rows_are_per_collector(no_shm_leak):
    ctrl = Control.create(3)
    try:
        other = Control.attach(ctrl.spec, index=2)
        other.chunks_done = 7
        other.log_episode(1.5, 10, 80)
        ctrl.row(1).chunks_done = 4
        assert ctrl.slowest() == 0 and ctrl.chunks_done == 0
        ctrl.chunks_done = 5
        assert ctrl.slowest() == 4
        counts, episodes = ctrl.all_episodes_since([0, 0, 0])
        assert counts == [0, 0, 1] and episodes[:, :4].tolist() == [[1.5, 10, 80, 0]]
        ctrl.ask_snapshot(3)
        assert not ctrl.snapshots_taken() and other.snapshot_chunk == 3
        for i in range(3):
            ctrl.row(i).snapshot_done = ctrl.row(i).snapshot_req
        assert ctrl.snapshots_taken()
        ctrl.stop_all()
        assert other.stop
        other.close()
    finally:
        ctrl.close()
        ctrl.unlink()


def test_too_many_collectors_is_rejected():
    with pytest.raises(fs.ArgsError, match="--num-collectors must lie in"):
        fs.resolve_args(fs.Args(env="Pendulum", device="cpu", num_envs=4, num_collectors=5))


def _three_iterations(**flags):
    torch.manual_seed(0)
    args = fs.resolve_args(fs.Args(env="Pendulum", device="cpu", critic_hidden=32,
                                   actor_hidden=32, num_atoms=11, batch_size=16,
                                   updates_per_iter=4, **flags))
    learner = fs.Learner(args, 3, 1, np.array([-2.0], np.float32), np.array([2.0], np.float32),
                         torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = {"obs": torch.randn(64, 3, generator=g),
                 "next_obs": torch.randn(64, 3, generator=g),
                 "actions": torch.rand(64, 1, generator=g) * 4 - 2,
                 "rewards": torch.randn(64, generator=g), "discounts": torch.full((64,), 0.9)}
        metrics = learner.train_iteration(batch)
    return {k: float(v) for k, v in metrics.items()}, learner


def test_logged_grad_norms_are_those_of_the_last_updates():
    """The gradient norms are read once per iteration, at its end: they equal the norms of
    the last critic update's and the last actor update's gradients as each optimizer stepped
    (5 updates, an actor update every 2nd: the last actor update is the 4th)."""
    args = fs.resolve_args(fs.Args(env="Pendulum", device="cpu", critic_hidden=32,
                                   actor_hidden=32, num_atoms=11, batch_size=16,
                                   updates_per_iter=5, compile=False, amp=False))
    learner = fs.Learner(args, 3, 1, np.array([-2.0], np.float32), np.array([2.0], np.float32),
                         torch.device("cpu"))
    seen = {}
    for name in ("critic", "actor"):
        params = learner.online_params if name == "critic" else learner.actor.parameters()
        params = list(params)
        getattr(learner, f"{name}_opt").register_step_pre_hook(
            lambda *_, name=name, params=params: seen.__setitem__(name, fs.grad_norm(params)))
    g = torch.Generator().manual_seed(1)
    batch = {"obs": torch.randn(80, 3, generator=g), "next_obs": torch.randn(80, 3, generator=g),
             "actions": torch.rand(80, 1, generator=g) * 4 - 2,
             "rewards": torch.randn(80, generator=g), "discounts": torch.full((80,), 0.9)}
    for _ in range(2):
        metrics = learner.train_iteration(batch)
        assert torch.equal(metrics["critic_grad_norm"], seen["critic"])
        assert torch.equal(metrics["actor_grad_norm"], seen["actor"])
        assert seen["critic"] > 0 and seen["actor"] > 0


@pytest.mark.slow
@pytest.mark.algorithm
def test_compiled_and_bf16_updates_agree_with_eager():
    """--compile computes the same updates (it draws the same noise, eagerly: Learner.noise);
    --amp stays close to float32."""
    eager, learner = _three_iterations(compile=False, amp=False)
    compiled, compiled_learner = _three_iterations(compile=True, amp=False)
    for k in eager:
        assert compiled[k] == pytest.approx(eager[k], rel=1e-4, abs=1e-5), k
    for a, b in zip(learner.critics.parameters(), compiled_learner.critics.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    bf16, _ = _three_iterations(compile=False, amp=True)
    assert bf16["qf_loss"] == pytest.approx(eager["qf_loss"], rel=0.02)


def test_cudagraphs_on_a_cpu_is_eager_and_the_gpu_data_path_stays_off():
    """--cudagraphs on a CPU is the stand-in that replays eager ops (common/graph.py): with
    --compile it is refused with the fix, without it accepted."""
    with pytest.raises(fs.ArgsError, match="add --compile False"):
        fs.resolve_args(fs.Args(env="Pendulum", device="cpu", cudagraphs=True, compile=True))
    assert fs.resolve_args(fs.Args(env="Pendulum", device="cpu", cudagraphs=True,
                                   compile=False)).cudagraphs
    args = fs.resolve_args(fs.Args(env="Pendulum", device="cpu"))
    assert not (args.prefetch or args.replay_mirror)  # the GPU's data path stays off


@pytest.mark.algorithm
def test_cpu_fast_path_defaults_follow_the_cpu_and_the_run_length(monkeypatch):
    """--compile and --amp default to on for a long CPU run where the CPU multiplies bf16
    natively and a C++ compiler is there; off for a short try, after --compile False, and on
    a CPU without native bf16 (stood in for by torch's flag readers saying no)."""
    long_run = fs.Args(env="Pendulum", device="cpu")  # (1M env steps: 125k updates)
    short = dataclasses.replace(long_run, total_timesteps=8000, learning_starts=1000)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    args = fs.resolve_args(long_run)
    assert args.compile == args.amp == native
    assert not fs.resolve_args(short).compile and not fs.resolve_args(short).amp
    args = fs.resolve_args(dataclasses.replace(long_run, compile=False))
    assert not (args.compile or args.amp)
    args = fs.resolve_args(dataclasses.replace(long_run, amp=False))
    assert args.compile == native and not args.amp
    for isa in ("avx512_bf16", "amx_tile"):
        monkeypatch.setattr(torch.cpu, f"_is_{isa}_supported", lambda: False)
    args = fs.resolve_args(long_run)
    assert not (args.compile or args.amp)  # today's CPU defaults
    assert fs.fast_path_default(args) == (False, "this CPU has no native bf16 (AMX or "
                                                 "AVX512-BF16)")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "")  # (no g++ or clang++ either)
    assert fs.fast_path_default(args) == (False, "no C++ compiler for torch.compile (g++ or "
                                                 "clang++, or $CXX)")
    # the line a run prints at its start says what was chosen and why
    line = fs.settings_line(args, frozenset({"compile", "amp"}))
    assert line.startswith(f"{fs.SCRIPT} on cpu (") and "8 envs in 1 collector(s)" in line
    assert "batch 256 x 8 updates per 8 steps of each env, actor 256, critics 256" in line
    assert "eager float32 (no C++ compiler for torch.compile" in line


@pytest.mark.parametrize("script", ["fast_sac.py", "fast_td3.py", "fast_sac_multigpu.py"])
def test_help_shows_what_each_machine_dependent_default_becomes(script):
    """--help says what a field that resolve_args fills becomes (a recipe size its CPU and
    GPU values), never a bare None."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, script_file(script)), "--help"],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, COLUMNS="200"))
    assert res.returncode == 0, res.stderr
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", res.stdout).split())
    assert text.count("(default: None)") == 3, text  # --run-dir, --resume, --checkpoint
    mod = script_module(script)
    for name, cpu in mod.CPU_RECIPE.items():
        gpu = mod.GPU_RECIPE[name]
        shown = f"{cpu:,}" if cpu == gpu else f"CPU {cpu:,}, GPU {gpu:,}"
        assert f"(default: {shown}" in text, name  # (fast_td3: then its CPU_FAMILY)
    assert "(default: 100000)" in text  # --save-interval


def test_cpp_wrapper_only_on_a_cpu_with_python_headers(monkeypatch, tmp_path):
    """--compile uses inductor's C++ wrapper on a CPU where Python.h is there (it builds each
    graph as an extension module); without the headers and on CUDA, not."""
    args, cpu = fs.Args(), torch.device("cpu")
    headers = (Path(sysconfig.get_path("include")) / "Python.h").exists()
    assert fs.compile_settings(args, cpu) == {"options": {"cpp_wrapper": headers}}
    assert fs.compile_settings(args, torch.device("cuda")) == {"options": {"cpp_wrapper": False}}
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))  # no Python.h
    assert fs.compile_settings(args, cpu) == {"options": {"cpp_wrapper": False}}


def test_non_finite_loss_stops_every_rank_that_agrees():
    finite = {"qf_loss": torch.tensor(1.0)}
    fs.check_finite(finite, 100, 10)  # nothing wrong
    with pytest.raises(fs.Diverged, match="non-finite loss"):
        fs.check_finite({"qf_loss": torch.tensor(float("nan"))}, 100, 10)
    # a rank whose own losses are finite stops when another rank's were not
    with pytest.raises(fs.Diverged, match="on another rank"):
        fs.check_finite(finite, 100, 10, agree=lambda bad: True)


def test_compile_warm_up_leaves_no_trace():
    """--compile's warm-up update puts back the networks, the optimizers, the update count
    and the random state (that it compiles: test_compile_failure_stops_before_anything_starts
    in test_runs.py)."""
    torch.manual_seed(0)
    args = fs.resolve_args(fs.Args(env="Pendulum", device="cpu", critic_hidden=32,
                                   actor_hidden=32, num_atoms=11, batch_size=16, compile=True))
    learner = fs.Learner(args, 3, 1, np.array([-2.0], np.float32), np.array([2.0], np.float32),
                         torch.device("cpu"))
    before, rng = copy.deepcopy(fs.learner_state(learner)), torch.get_rng_state()
    fs.warm_up(learner)
    after = fs.learner_state(learner)
    assert torch.equal(torch.get_rng_state(), rng) and after["num_updates"] == 0
    for key in ("actor", "critics", "critics_target"):
        assert all(torch.equal(before[key][k], v) for k, v in after[key].items()), key
    assert all(not after[opt]["state"] for opt in ("actor_opt", "critic_opt", "alpha_opt"))


def test_replay_mirror_that_does_not_fit_is_refused(monkeypatch):
    """On a CUDA machine the mirror's size is checked against the GPU's free memory before
    anything starts (this machine has no GPU: its free memory is what the test says)."""
    args = fs.Args(env="Humanoid", device="cpu", num_envs=32, buffer_size=1_000_000,
                   batch_size=4096, updates_per_iter=32)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=0: (2 * 2**30, 80 * 2**30))
    with pytest.raises(fs.ArgsError, match=r"needs 2\.7 GiB .* 0\.7 GiB for samples, but 2\.0 "
                       r"GiB are free.*--replay-mirror False"):
        check_mirror_fits(args, 348, 17)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=0: (4 * 2**30, 80 * 2**30))
    check_mirror_fits(args, 348, 17)  # fits


@pytest.mark.algorithm
def test_target_entropy_and_logged_entropy_are_per_dimension_in_the_box():
    """Pendulum's actions lie in [-2, 2]: the box's half-width 2 adds log 2 to every
    log-density in env units, so a box-unit target of -0.5 is -0.5 + log 2 there, and the
    logged entropy is converted back to the box."""
    metrics, learner = _three_iterations(compile=False, amp=False, target_entropy=-0.5)
    assert learner.target_entropy == pytest.approx(-0.5 + math.log(2))
    obs = torch.randn(4096, 3)
    _, log_prob = learner.actor.sample(learner.actor.normalizer(obs), learner.noise(4096))
    box_entropy = -log_prob.mean().item() - math.log(2)
    assert learner.update_actor(obs)["entropy"].item() == pytest.approx(box_entropy, abs=0.1)
    assert {"entropy", "qf_value", "alpha", "actor_loss"} <= set(metrics)


@pytest.mark.algorithm
@pytest.mark.parametrize("use_cdq", [True, False])
def test_critic_target_and_actor_objective_follow_use_cdq(use_cdq):
    """Two critics that disagree (one says 6, the other -6): with CDQ the critic trains
    towards the lower one and the actor sees the lower one; without, both see the average."""
    torch.manual_seed(0)
    args = fs.resolve_args(fs.Args(env="Pendulum", device="cpu", use_cdq=use_cdq,
                                   critic_hidden=32, actor_hidden=32, num_atoms=11,
                                   v_min=-10.0, v_max=10.0, critic_lr=1e-2, alpha_init=1e-6))
    args = dataclasses.replace(args, tau=0.0)  # keep the target fixed
    learner = fs.Learner(args, 3, 1, np.array([-2.0], np.float32),
                         np.array([2.0], np.float32), torch.device("cpu"))
    with torch.no_grad():
        for p in learner.critics_target.parameters():
            p.zero_()
        learner.critics_target.net[-1].bias[0, 0, 8] = 50.0  # critic 0: 6.0 (atom 8)
        learner.critics_target.net[-1].bias[1, 0, 2] = 50.0  # critic 1: -6.0
    obs, actions = torch.randn(64, 3), torch.rand(64, 1) * 4 - 2
    for _ in range(200):  # (alpha ~ 0: the entropy bonus does not move the target)
        learner.update_critic(obs, actions, torch.zeros(64), obs, torch.ones(64))
    q = learner.critics.q_values(obs, actions).mean().item()
    assert q == pytest.approx(-6.0 if use_cdq else 0.0, abs=0.5)
    learner.critics.load_state_dict(learner.critics_target.state_dict())
    q_actor = learner.actor_loss(obs, learner.noise(64))[1]["qf_value"]
    assert q_actor.item() == pytest.approx(-6.0 if use_cdq else 0.0, abs=0.01)


def test_stop_request_ignores_a_repeated_sigterm_but_not_ctrl_c():
    """The first signal asks for a checkpoint; the same SIGTERM again (a scheduler and
    torchrun both send it) is no abort, Ctrl-C after it is."""
    import os
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = fs.StopRequest()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        stop = fs.StopRequest()
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


class _HostReads(TorchDispatchMode):
    """Records every read of a tensor's value by the host: .item(), bool(), int(), float()
    and .tolist() on any device reach aten._local_scalar_dense here, or the Tensor methods
    that `methods` (a TorchFunctionMode) sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class _HostReadMethods(torch.overrides.TorchFunctionMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy"):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("script", ["fast_sac.py", "fast_td3.py"])
def test_an_iteration_never_asks_the_device_for_a_value(script):
    """No host sync inside a learner iteration (on a GPU each would wait for every update
    queued before it, and none can be captured in a CUDA graph): the updates, the target
    update and the metrics stay tensors on the device; the loop reads them once, later. A
    deliberate .item() inside the iteration is seen (the check itself works)."""
    mod = script_module(script)
    args = mod.resolve_args(mod.Args(env="Pendulum", device="cpu", critic_hidden=32,
                                     actor_hidden=32, num_atoms=11, batch_size=16,
                                     updates_per_iter=4, compile=False, amp=False))
    learner = mod.Learner(args, 3, 1, np.array([-2.0], np.float32),
                          np.array([2.0], np.float32), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    batch = {"obs": torch.randn(64, 3, generator=g), "next_obs": torch.randn(64, 3, generator=g),
             "actions": torch.rand(64, 1, generator=g) * 4 - 2,
             "rewards": torch.randn(64, generator=g), "discounts": torch.full((64,), 0.9)}
    learner.train_iteration(batch)  # (the optimizers' state exists from here on)
    reads = _HostReads()
    with reads, _HostReadMethods(reads.seen):
        metrics = learner.train_iteration(batch)
    assert reads.seen == [] and all(isinstance(v, torch.Tensor) for v in metrics.values())
    with reads, _HostReadMethods(reads.seen):
        metrics["qf_loss"].item()
    assert "item" in reads.seen and "aten._local_scalar_dense.default" in reads.seen
