"""What fast_td3.py changes relative to fast_sac.py."""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import script_module

td3 = script_module("fast_td3.py")
# (every test here checks fast_td3.py's own algorithm)
pytestmark = [pytest.mark.script("fast_td3.py"), pytest.mark.algorithm]


def test_noise_std_redrawn_only_for_finished_episodes():
    args = dataclasses.replace(td3.Args(), std_min=0.1, std_max=0.3)
    rng = np.random.default_rng(0)
    std = td3.draw_noise_std(rng, args, 6)
    assert std.shape == (6, 1) and (std >= 0.1).all() and (std <= 0.3).all()
    assert len(np.unique(std)) == 6  # per env, not one shared value
    done = np.array([False, True, False, False, True, False])
    new = td3.redraw_noise_std(std, done, rng, args)
    assert (new[~done] == std[~done]).all()
    assert (new[done] != std[done]).all()
    assert (new >= 0.1).all() and (new <= 0.3).all()
    assert td3.redraw_noise_std(std, np.zeros(6, bool), rng, args) is std


def test_cdq_picks_distribution_with_lower_mean():
    support = torch.tensor([0.0, 1.0, 2.0])
    high = torch.tensor([0.0, 0.0, 1.0])  # mean 2
    low = torch.tensor([1.0, 0.0, 0.0])  # mean 0
    probs = torch.stack([torch.stack([high, low]), torch.stack([low, high])])  # [K=2, B=2, N]
    chosen = td3.lower_mean_distribution(probs, support)
    assert torch.equal(chosen, torch.stack([low, low]))


@pytest.mark.parametrize("use_cdq", [True, False])
def test_critic_target_follows_use_cdq(use_cdq):
    """With a frozen target whose two critics disagree, the trained critic's mean moves
    towards the lower one under CDQ and towards the average without it."""
    torch.manual_seed(0)
    args = td3.resolve_args(td3.Args(env="Pendulum", device="cpu", use_cdq=use_cdq,
                                     critic_hidden=32, actor_hidden=32, num_atoms=11,
                                     v_min=-10.0, v_max=10.0, critic_lr=1e-2))
    args = dataclasses.replace(args, tau=0.0)  # keep the target fixed
    learner = td3.Learner(args, 3, 1, np.array([-2.0], np.float32),
                          np.array([2.0], np.float32), torch.device("cpu"))
    with torch.no_grad():  # target critic 0 always says 6.0 (atom 8), critic 1 says -6.0
        for p in learner.critics_target.parameters():
            p.zero_()
        last = learner.critics_target.net[-1]
        last.bias[0, 0, 8] = 50.0
        last.bias[1, 0, 2] = 50.0
    obs, actions = torch.randn(64, 3), torch.rand(64, 1) * 4 - 2
    for _ in range(200):
        learner.update_critic(obs, actions, torch.zeros(64), obs, torch.ones(64))
    q = learner.critics.q_values(obs, actions).mean().item()
    assert q == pytest.approx(-6.0 if use_cdq else 0.0, abs=0.5)


def test_smoothing_noise_is_clipped_and_actions_stay_in_bounds():
    torch.manual_seed(0)
    low, high = np.array([-2.0, -1.0], np.float32), np.array([2.0, 3.0], np.float32)
    actor = td3.Actor(4, 2, 32, low, high)
    x = torch.randn(20_000, 4)
    clean = actor(x)
    noise = torch.randn(20_000, 2) * 5.0  # huge std: almost every draw is clipped
    noisy = actor.noisy(x, noise, clip=0.1)
    deviation = (noisy - clean) / actor.scale
    assert deviation.abs().max() <= 0.1 + 1e-6
    assert (deviation.abs() > 0.099).float().mean() > 0.9
    wild = actor.noisy(x, noise)  # unclipped exploration noise still respects the bounds
    assert (wild >= torch.tensor(low)).all() and (wild <= torch.tensor(high)).all()


@pytest.mark.parametrize("env, updates", [("Hopper", 16), ("HalfCheetah", 8), ("Humanoid", 8),
                                          ("Reacher", 8)])
def test_cpu_recipe_per_env_family_unless_given(env, updates):
    """CPU_FAMILY changes the CPU recipe per env family; a given flag and the GPU recipe
    win over it."""
    assert td3.resolve_args(td3.Args(env=env, device="cpu")).updates_per_iter == updates
    given = td3.resolve_args(td3.Args(env=env, device="cpu", updates_per_iter=4))
    assert given.updates_per_iter == 4
    assert td3.GPU_RECIPE["updates_per_iter"] == 32 != td3.CPU_FAMILY["Hopper"]["updates_per_iter"]


@pytest.mark.parametrize("env, lr", [("Ant", 1e-3), ("HalfCheetah", 3e-4), ("Reacher", 3e-4)])
def test_learning_rates_per_env_family_unless_given(env, lr):
    """LEARNING_RATE sets both learning rates per env family (an env it lacks: the default);
    a given flag wins for its network alone."""
    args = td3.resolve_args(td3.Args(env=env, device="cpu"))
    assert (args.actor_lr, args.critic_lr) == (lr, lr)
    args = td3.resolve_args(td3.Args(env=env, device="cpu", critic_lr=5e-4))
    assert (args.actor_lr, args.critic_lr) == (lr, 5e-4)
