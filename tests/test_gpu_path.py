"""What a CPU can check of the GPU path: the mirror after a collector restart, float32
log-densities under bf16 autocast, and the temperature loss folded into the actor's."""

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ORIGINALS, ROOT, SMALL, script_file, script_module

from common.collectors import Collectors
from common.replay import Mirror, ReplayBuffer

fs = script_module("fast_sac.py")
pytestmark = pytest.mark.script("fast_sac.py")


def assert_same_batches(rb, mirror, host_rng, written, window, n_step, gamma):
    expected = rb.sample(host_rng, mirror.rows, n_step, gamma, written, window)
    got = mirror(written, window, 0)
    for key, value in expected.items():
        assert torch.equal(got[key], torch.from_numpy(value)), key


@pytest.mark.script(*ORIGINALS)  # (common/'s alone)
def test_mirror_copies_episode_ends_marked_after_commit(no_shm_leak):
    """end_episodes (what a collector restart calls) on rows the mirror already holds: its
    next batches still equal the host's, n-step sums stopping at the new episode end."""
    E, C, n, gamma = 2, 16, 3, 0.9
    rb = ReplayBuffer.create(num_envs=E, capacity=C, obs_dim=2, act_dim=1)
    try:
        data = np.random.default_rng(0)
        for t in range(12):
            rb.write(slice(None), t, data.normal(size=(E, 2)), data.normal(size=(E, 1)),
                     data.normal(size=E), data.normal(size=(E, 2)), np.zeros(E), np.zeros(E))
        rb.commit(slice(None), 12)
        mirror = Mirror(rb, np.random.default_rng(1), torch.device("cpu"), 512, n, gamma)
        host = np.random.default_rng(1)
        assert_same_batches(rb, mirror, host, 12, 0, n, gamma)
        rb.end_episodes(slice(1, 2), 9)  # env 1's episode ends at step 9
        assert mirror.fields["dones"][1, 9] == 0  # (the copy made before)
        assert_same_batches(rb, mirror, host, 12, 0, n, gamma)
        assert mirror.fields["dones"][1, 9] == 1 and mirror.fields["dones"][0, 9] == 0
    finally:
        rb.close()
        rb.unlink()


@pytest.mark.slow
def test_mirror_batches_equal_host_batches_after_a_collector_restart(tmp_path, no_shm_leak):
    """Real collectors in lockstep, one killed and restarted by Collectors: the restart marks
    the dead collector's last committed row, which the mirror already holds, as an episode
    end; the mirror's batches stay equal to the host's bit for bit (n-step 3)."""
    S, n, gamma = 7, 3, 0.97  # (7: the marked row is never one of Pendulum's truncations)
    args = fs.resolve_args(fs.Args(env="Pendulum-v1", device="cpu", num_envs=2,
                                   num_collectors=2, steps_per_iter=S, n_step=n,
                                   total_timesteps=100_000, learning_starts=0,
                                   buffer_size=4000, sync_mode="lockstep", actor_hidden=32,
                                   batch_size=32, restart_collector=True))
    obs_dim, act_dim, low, high = fs.env_dims(args.env)
    actor = fs.make_actor(args, obs_dim, act_dim, low, high)
    collectors = Collectors.create("test", args, str(tmp_path), actor, obs_dim, act_dim)
    rb = collectors.rb
    mirror = Mirror(rb, np.random.default_rng(5), torch.device("cpu"), 4096, n, gamma)
    host = np.random.default_rng(5)
    try:
        collectors.ws.publish(actor, 0)
        collectors.start(fs.make_env, fs.Explorer, [None, None])
        for iteration in range(10):
            chunks, window = collectors.wait_for_chunk(iteration, 0)
            assert_same_batches(rb, mirror, host, chunks * S, window, n, gamma)
            if iteration == 6:  # collector 1 has done chunks 0..6 and waits for weights 7
                assert mirror.fields["dones"][1, 7 * S - 1] == 0
                os.kill(collectors.procs[1].pid, signal.SIGKILL)
                collectors.procs[1].join()
            collectors.ws.publish(actor, iteration + 1)
        assert collectors.restarts == 1
        # the restart marked its last row (on the device since iteration 6) as an episode end
        assert rb.dones[1, 7 * S - 1] == 1 and rb.dones[0, 7 * S - 1] == 0
        assert mirror.fields["dones"][1, 7 * S - 1] == 1
        written = chunks * S
        assert torch.equal(mirror.fields["dones"][:, :written],
                           torch.from_numpy(rb.dones[:, :written].copy()))
    finally:
        collectors.close()


@pytest.mark.algorithm
def test_actor_log_prob_is_float32_under_bf16_autocast():
    """Under --amp the layers run in bf16, but the noise, the squashing and the
    log-density are float32: the same numbers as computing them in float32 from the
    layers' outputs."""
    torch.manual_seed(0)
    low, high = np.full(6, -0.4, np.float32), np.full(6, 0.4, np.float32)
    actor = fs.Actor(17, 6, 64, low, high, -5.0, 1.0)
    x, eps = torch.randn(512, 17), torch.randn(512, 6)
    with torch.autocast("cpu", torch.bfloat16):
        mu, log_std = actor(x)
        action, log_prob = actor.sample(x, eps)
    assert mu.dtype == log_std.dtype == action.dtype == log_prob.dtype == torch.float32
    assert actor.trunk[0](x).dtype == torch.float32  # (outside autocast)
    with torch.autocast("cpu", torch.bfloat16):
        assert actor.trunk[0](x).dtype == torch.bfloat16  # the layers do run in bf16
    y = torch.tanh(mu + log_std.exp() * eps)
    expected = (-0.5 * eps.square() - log_std - 0.5 * math.log(2 * math.pi)
                - torch.log(actor.scale * (1 - y.square()) + 1e-6)).sum(-1)
    torch.testing.assert_close(log_prob, expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(action, y * actor.scale + actor.bias)
    # a bf16 log-density is off by far more than that tolerance
    assert (expected.bfloat16().float() - expected).abs().max() > 1e-3


@pytest.mark.algorithm
def test_folded_temperature_loss_gives_each_parameter_its_own_gradient():
    """One backward of the actor's loss plus the temperature's: the actor's parameters get
    the actor loss's gradient and log_alpha the temperature loss's, as with two backwards."""
    args = fs.resolve_args(fs.Args(env="Pendulum-v1", device="cpu", actor_hidden=32,
                                   critic_hidden=32, num_atoms=11, compile=False, amp=False),
                           check_shm=False)
    learner = fs.Learner(args, 3, 1, np.array([-2.0], np.float32),
                         np.array([2.0], np.float32), torch.device("cpu"))
    obs = torch.randn(256, 3)
    params = [*learner.actor.parameters(), learner.log_alpha]
    eps = learner.noise(256)  # (the same noise for the two losses apart)
    loss, metrics = learner.actor_loss(obs, eps)
    folded = torch.autograd.grad(loss, params)
    actions, log_prob = learner.actor.sample(obs, eps)
    q = learner.critics.q_values(obs, actions).min(0).values
    actor_loss = (learner.log_alpha.detach().exp() * log_prob - q).mean()
    alpha_loss = -(learner.log_alpha.exp() * (log_prob.detach()
                                              + learner.target_entropy)).mean()
    apart = torch.autograd.grad(actor_loss, params[:-1]) + torch.autograd.grad(
        alpha_loss, params[-1:])
    for a, b in zip(folded, apart):
        assert torch.equal(a, b)  # (bit for bit: the CPU path computes what it did before)
    assert folded[-1].abs() > 0 and metrics["alpha_loss"] == pytest.approx(alpha_loss.item())
    assert metrics["actor_loss"] == pytest.approx(actor_loss.item())


@pytest.mark.slow
@pytest.mark.script("fast_sac_multigpu.py")
def test_two_ranks_async_agree_on_progress_and_stop_in_one_allreduce(tmp_path, no_shm_leak):
    """Async mode under torchrun (gloo): progress and the stop flag are agreed on in one
    all-reduce at the top of the loop, the prefetch's progress in another; the ranks stay
    in step to the end and finish with identical parameters."""
    run_dir = str(tmp_path / "run")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2",
                          os.path.join(ROOT, script_file("fast_sac_multigpu.py")),
                          *SMALL, "--total-timesteps", "1000", "--sync-mode", "async",
                          "--run-dir", run_dir, "--prefetch", "True", "--replay-mirror", "True"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    assert s["status"] == "completed" and s["num_updates"] > 0 and s["world_size"] == 2
    assert s["rank_param_hashes"][0] == s["rank_param_hashes"][1]
