"""FastTD3: TD3 with distributional critics, fed by asynchronous CPU collectors.

    python fast_td3.py --env Humanoid
    python fast_td3.py --env HalfCheetah --sync-mode lockstep --total-timesteps 200000

This process is the learner (on the GPU when there is one). Collector subprocesses (CPU)
step the envs and write transitions into a replay buffer in shared memory; the learner
samples it, trains, and publishes the actor's weights back through shared memory.

Read top to bottom: Args -> recipe -> env -> networks -> how a collector acts -> Learner
(losses, update rule) -> the training loop -> checkpoints -> main. To try an idea, copy this
file and edit the first part; the plumbing below the loop's marker rarely needs a change.
common/ moves the bytes between processes; DESIGN.md explains how.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import checkpoints
from common.collectors import (
    ArgsError,
    CollectorError,
    Collectors,
    Interrupted,
    StopRequest,
    available_cores,
    check_sizes,
    default_learner_threads,
    default_num_collectors,
)
from common.control import COLLECT_S, WEIGHT_LOAD_S, WEIGHT_WAIT_S
from common.graph import IterationGraph
from common.replay import Mirror, Sampler, batch_shapes
from common.trace import NO_TIMELINE, Trace

SCRIPT = Path(__file__).stem  # names runs, checkpoints and processes: copies need no edit


# =======================================================================================
# Arguments: the algorithm's first, then how the run is kept


def default(text: str):
    """--help's "(default: ...)" of a field that resolve_args fills for the machine."""
    import tyro  # (here: the collectors import this file but parse no arguments)

    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")

def recipe(name: str):
    """--help's default of a recipe size (CPU_RECIPE and GPU_RECIPE, below)."""
    cpu, gpu = CPU_RECIPE[name], GPU_RECIPE[name]
    return default(f"{cpu:,}" if cpu == gpu else f"CPU {cpu:,}, GPU {gpu:,}")


@dataclass
class Args:
    env: str = "Humanoid"
    """gymnasium id; a short name (Humanoid) means its newest version (Humanoid-v5)"""
    seed: int = 1
    """seed of networks, sampling, exploration and environments"""
    total_timesteps: int = 1_000_000
    """environment steps to collect, summed over all envs"""
    policy_frequency: int = 2
    """critic updates per actor update"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.01
    """soft target update rate: target <- target + tau * (online - target)"""
    n_step: int = 3
    """n-step returns, stopped at episode ends"""
    actor_lr: Annotated[float | None, default("LEARNING_RATE: 1e-3 on Ant")] = None
    """actor learning rate (AdamW); 3e-4 on an env family that LEARNING_RATE lacks"""
    critic_lr: Annotated[float | None, default("as --actor-lr")] = None
    """critic learning rate (AdamW)"""
    weight_decay: float = 0.001
    """AdamW weight decay of actor and critics"""
    std_min: float = 0.001
    """lowest exploration noise std (a fraction of the action range's half-width)"""
    std_max: float = 0.4
    """highest exploration noise std; each env draws its own for every episode"""
    policy_noise: float = 0.2
    """std of the target policy smoothing noise (a fraction of the half-width)"""
    noise_clip: float = 0.5
    """the smoothing noise is clipped to [-noise-clip, noise-clip]"""
    use_cdq: bool = True
    """clipped double Q: the target uses the lower critic; off: the mean of both"""
    num_atoms: int = 101
    """atoms of the distributional (C51) critics"""
    v_min: Annotated[float | None, default("VALUE_RANGES per env family; an env it lacks: "
                                           "the returns seen, see ReturnRange")] = None
    """lowest value of the critics' support"""
    v_max: Annotated[float | None, default("as --v-min")] = None
    """highest value of the critics' support"""

    # sizes: the recipe for the learner's device (CPU_RECIPE, GPU_RECIPE) unless given
    num_envs: Annotated[int | None, recipe("num_envs")] = None
    """parallel environments, all collectors together"""
    buffer_size: Annotated[int | None, recipe("buffer_size")] = None
    """replay capacity in transitions, all envs together"""
    batch_size: Annotated[int | None, recipe("batch_size")] = None
    """transitions per gradient update"""
    learning_starts: Annotated[int | None, recipe("learning_starts")] = None
    """environment steps of uniform random actions before the first update"""
    steps_per_iter: Annotated[int | None, recipe("steps_per_iter")] = None
    """environment steps per env between learner iterations"""
    updates_per_iter: Annotated[int | None, default("CPU 8, GPU 32; on a CPU, CPU_FAMILY: 16 "
                                                    "on Hopper")] = None
    """gradient updates per learner iteration"""
    actor_hidden: Annotated[int | None, recipe("actor_hidden")] = None
    """width of the actor's first layer; later layers halve it"""
    critic_hidden: Annotated[int | None, recipe("critic_hidden")] = None
    """width of the critics' first layer; later layers halve it"""

    # how the run is kept
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """where the learner runs (auto: cuda when available); collectors always use the CPU"""
    sync_mode: Literal["lockstep", "pipelined", "async"] = "pipelined"
    """lockstep: collect, then learn; pipelined: collect chunk i+1 while learning on chunk i
    (both deterministic); async: collectors run freely (not deterministic)"""
    num_collectors: Annotated[int | None, default(
        "CPU learner: 1 on up to 4 cores, else a quarter of them; GPU: the cores left after "
        "one per learner rank and one more; at most --num-envs / 4")] = None
    """collector processes, each stepping a slice of the envs"""
    run_dir: str | None = None
    """output folder (None: runs/{env}__{script}__{seed}__{timestamp})"""
    save_interval: int = 100_000
    """env steps between checkpoints (each with the collectors' state), so that --resume auto
    continues after a crash; 0: only a signal's checkpoint and model_final.pt"""
    keep_checkpoints: int = 2
    """checkpoint_*.pt files kept (with their replay files); model_final.pt always stays"""
    save_replay: bool = False
    """store the replay buffer with each checkpoint, so that a resumed run continues exactly"""
    resume: str | None = None
    """run dir or checkpoint to continue with its arguments, written into that run dir
    unless --run-dir is given; flags given now override them (not the run's shapes:
    RESUME_FIXED, Learner.FIXED), and the machine's settings (MACHINE) are resolved again;
    auto: --run-dir's newest complete checkpoint, else a fresh start"""
    restart_collector: bool = False
    """if a collector dies, start a fresh one and carry on instead of exiting"""
    eval_interval: int = 50_000
    """env steps between deterministic evaluations; 0 evaluates only at the end"""
    eval_episodes: int = 5
    """episodes per evaluation"""
    eval_only: bool = False
    """only evaluate --checkpoint for --eval-episodes episodes, print mean and std"""
    checkpoint: str | None = None
    """checkpoint file or run dir for --eval-only"""
    capture_video: bool = False
    """record an episode at each evaluation to {run_dir}/videos (MUJOCO_GL=egl or osmesa)"""
    log_interval: float = 10.0
    """seconds between progress lines (off a terminal; on one, a progress bar)"""
    quiet: bool = False
    """no progress bar or lines (evaluations and errors are still printed)"""
    track: bool = False
    """log to Weights & Biases (needs wandb)"""
    wandb_project: str = "fast-rl"
    """wandb project name"""
    trace: bool = False
    """write a timeline of the learner and every collector to {run_dir}/trace.json"""
    trace_events: int = 40_000
    """--trace: records kept per process, the first half and the newest half"""

    # speed: resolved for the machine unless given (the run prints what it chose, and why)
    compile: Annotated[bool | None, default("on with CUDA, else off")] = None
    """torch.compile the losses of the update steps"""
    cudagraphs: bool = False
    """the learner's whole iteration, optimizer steps included, in one CUDA graph (see
    common/graph.py); on a CPU with --compile False a stand-in, for tests"""
    amp: Annotated[bool | None, default("on with CUDA, else off")] = None
    """bf16 autocast in the update steps (the output layers stay float32)"""
    prefetch: Annotated[bool | None, default("on with CUDA, else off")] = None
    """gather the next iteration's batch while this one trains"""
    replay_mirror: Annotated[bool | None, default("on with CUDA, else off")] = None
    """keep a copy of the replay buffer in the learner's device memory and sample there"""
    learner_threads: Annotated[int | None, default("the cores the collectors leave")] = None
    """torch threads of the learner on a CPU"""


# Support [v_min, v_max] of the C51 critics per env family: the discounted returns (about a
# tenth of a 1000-step episode's return at gamma 0.99), with room above the best published
# returns (HalfCheetah 15-17k, Humanoid 10-12k, Ant and Walker2d 6-8k, Hopper 4k).
VALUE_RANGES = {"Pendulum": (-1700.0, 0.0), "HalfCheetah": (-200.0, 2500.0),
    "Humanoid": (-100.0, 1500.0), "HumanoidStandup": (0.0, 20000.0), "Hopper": (-100.0, 600.0),
    "Walker2d": (-100.0, 1200.0), "Ant": (-200.0, 1200.0), "InvertedPendulum": (0.0, 110.0),
    "InvertedDoublePendulum": (0.0, 1000.0)}

CPU_RECIPE = dict(num_envs=8, buffer_size=1_000_000, batch_size=256, learning_starts=5000,
                  steps_per_iter=8, updates_per_iter=8, actor_hidden=256, critic_hidden=256)
GPU_RECIPE = dict(num_envs=32, buffer_size=1_000_000, batch_size=4096, learning_starts=5000,
                  steps_per_iter=8, updates_per_iter=32, actor_hidden=512, critic_hidden=1024)
# What differs from CPU_RECIPE per env family: Hopper holds its return with more updates per
# env step (docs/recipe.md, "fast_td3 on Hopper and Humanoid").
CPU_FAMILY = {"Hopper": dict(updates_per_iter=16)}
# Learning rates of actor and critics per env family, on either device (docs/recipe.md).
LEARNING_RATE = {"Ant": 1e-3}
DEFAULT_LEARNING_RATE = 3e-4


# =======================================================================================
# Environments


def make_env(env_id: str, num_envs: int, seed: int = 0):
    """The collectors' vector env. SAME_STEP autoreset returns the reset observation at once
    and puts the true last one in info["final_obs"], so every step is a storable transition
    (the collectors seed env i with seed + i at the first reset)."""
    return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})


def env_dims(env_id: str) -> tuple[int, int, np.ndarray, np.ndarray]:
    env = gym.make(env_id)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    low, high = env.action_space.low.astype(np.float32), env.action_space.high.astype(np.float32)
    env.close()
    return obs_dim, act_dim, low, high


# =======================================================================================
# Networks


class Normalizer(nn.Module):
    """Running mean/variance of observations; its buffers travel with the actor's weights."""

    def __init__(self, dim: int, clip: float = 10.0):
        super().__init__()
        self.clip = clip
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        self.merge(x.shape[0], x.mean(0), x.var(0, unbiased=False))

    @torch.no_grad()
    def merge(self, n, mean: torch.Tensor, var: torch.Tensor) -> None:
        """Fold in the statistics (count, mean, variance) of n new observations."""
        total = self.count + n
        delta = mean - self.mean
        # parallel merge of two (mean, var, count) summaries
        self.var.mul_(self.count / total).add_(
            var * (n / total) + delta.square() * (self.count * n / total**2))
        self.mean.add_(delta * (n / total))
        self.count.fill_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (in place after the subtraction: the same numbers, up to 4x as fast on a learner's batch)
        return (x - self.mean).mul_(torch.rsqrt(self.var + 1e-8)).clamp_(-self.clip, self.clip)


def mlp(sizes: list[int]) -> nn.Sequential:
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.LayerNorm(b), nn.SiLU()]
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """Deterministic tanh-squashed policy with an input normalizer."""

    def __init__(self, obs_dim, act_dim, hidden, low, high):
        super().__init__()
        self.normalizer = Normalizer(obs_dim)
        self.trunk = mlp([obs_dim, hidden, hidden // 2, hidden // 4])
        self.mu = nn.Linear(hidden // 4, act_dim)
        self.register_buffer("scale", torch.as_tensor((high - low) / 2))
        self.register_buffer("bias", torch.as_tensor((high + low) / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Action in env units from a normalized observation."""
        h = self.trunk(x)
        # float32 output under --amp: in bf16 the output layers (the critics' too) slowed
        # fast_sac's learning per env step (docs/performance.md)
        with torch.autocast(h.device.type, enabled=False):
            return torch.tanh(self.mu(h.float())) * self.scale + self.bias

    def noisy(self, x: torch.Tensor, noise: torch.Tensor, clip: float | None = None):
        """forward(x) plus `noise` in half-widths (the caller draws it, a standard normal
        times the std: see Learner.noise; clipped to +-clip), kept inside the bounds."""
        action = self(x)
        if clip is not None:
            noise = noise.clamp(-clip, clip)
        low, high = self.bias - self.scale, self.bias + self.scale
        return torch.maximum(torch.minimum(action + noise * self.scale, high), low)

    @torch.inference_mode()  # (no autograd bookkeeping at all: measurably cheaper per step)
    def act(self, obs: torch.Tensor, deterministic: bool = False, generator=None, std=None):
        """Action for raw observations (normalized here); `std` [num_envs, 1] explores."""
        x = self.normalizer(obs)
        if deterministic:
            return self(x)
        noise = torch.randn(x.shape[0], len(self.scale), generator=generator, device=x.device)
        return self.noisy(x, noise * std)


def make_actor(args: Args, obs_dim: int, act_dim: int, low, high) -> Actor:
    return Actor(obs_dim, act_dim, args.actor_hidden, low, high)


class EnsembleLinear(nn.Module):
    """K independent linear layers applied as one batched matmul to input [K, B, in]."""

    def __init__(self, k: int, n_in: int, n_out: int):
        super().__init__()
        bound = 1 / math.sqrt(n_in)  # same init range as nn.Linear
        self.weight = nn.Parameter(torch.empty(k, n_in, n_out).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(k, 1, n_out).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class EnsembleLayerNorm(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(k, 1, n))
        self.bias = nn.Parameter(torch.zeros(k, 1, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:]) * self.weight + self.bias


class Critics(nn.Module):
    """Twin distributional critics, evaluated together: logits [2, B, num_atoms]."""

    def __init__(self, obs_dim, act_dim, hidden, num_atoms, v_min, v_max, k: int = 2):
        super().__init__()
        if v_min is None:  # (a stand-in until ReturnRange sets the support)
            v_min, v_max = -1.0, 1.0
        self.k = k
        sizes = [obs_dim + act_dim, hidden, hidden // 2, hidden // 4]
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [EnsembleLinear(k, a, b), EnsembleLayerNorm(k, b), nn.SiLU()]
        self.net = nn.Sequential(*layers, EnsembleLinear(k, sizes[-1], num_atoms))
        self.register_buffer("support", torch.linspace(v_min, v_max, num_atoms))
        with torch.no_grad():  # start at values near 0 (clamped into the support) rather
            # than at the support's midpoint, an optimistic guess when v_max has headroom
            width = (v_max - v_min) / 10
            self.net[-1].bias.copy_(-0.5 * ((self.support - min(max(0.0, v_min), v_max))
                                            / width) ** 2)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, action], -1)
        h = self.net[:-1](x.unsqueeze(0).expand(self.k, *x.shape))
        with torch.autocast(h.device.type, enabled=False):  # float32 logits: see Actor
            return self.net[-1](h.float())

    def q_values(self, obs, action) -> torch.Tensor:
        """Expected values [2, B] of the critics' distributions."""
        return (self(obs, action).softmax(-1) * self.support).sum(-1)


def project(probs, rewards, discounts, support) -> torch.Tensor:
    """C51 projection of the distribution r + discount * Z (probs [B, N] on support [N];
    rewards, discounts [B]) onto `support`: mass that lands between two atoms is split
    between them in proportion to the distance."""
    n = support.shape[0]
    v_min, v_max = support[0], support[-1]
    delta = (v_max - v_min) / (n - 1)
    tz = rewards[:, None] + discounts[:, None] * support
    b = ((tz - v_min) / delta).clamp(0, n - 1)  # (in atoms: at v_max, b can round past n - 1)
    lo, hi = b.floor().long(), b.ceil().long()
    # when b hits an atom exactly, lo == hi and both weights below would be 0: move one
    lo = torch.where((hi > 0) & (lo == hi), lo - 1, lo)
    hi = torch.where((lo < n - 1) & (lo == hi), hi + 1, hi)
    out = torch.zeros_like(probs)
    out.scatter_add_(1, lo, probs * (hi.to(b.dtype) - b))
    out.scatter_add_(1, hi, probs * (b - lo.to(b.dtype)))
    return out


def lower_mean_distribution(probs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Clipped double Q for distributional critics: per sample, the distribution of the
    critic whose expected value is lowest (probs [K, B, N] -> [B, N])."""
    lower = (probs * support).sum(-1).argmin(0)
    return probs[lower, torch.arange(probs.shape[1], device=probs.device)]


# =======================================================================================
# How a collector acts (an object of this class lives in each collector process: CPU, one
# torch thread). common/collectors.py steps the envs and writes the replay buffer.


class Explorer:
    """The actions of one collector's envs: uniform before --learning-starts, then the
    policy's plus Gaussian noise whose std each env draws anew for every episode (the
    actor's weights are loaded by the harness)."""

    def __init__(self, args: Args, index: int, num_envs: int):
        obs_dim, act_dim, self.low, self.high = env_dims(args.env)
        self.actor = make_actor(args, obs_dim, act_dim, self.low, self.high)
        self.args, self.shape = args, (num_envs, act_dim)
        self.rng = np.random.default_rng(args.seed + 1 + 1000 * index)
        self.gen = torch.Generator().manual_seed(args.seed + 2 + 1000 * index)
        self.noise_std = draw_noise_std(self.rng, args, num_envs)

    def act(self, obs: np.ndarray, random: bool) -> np.ndarray:
        if random:
            return self.rng.uniform(self.low, self.high, size=self.shape).astype(np.float32)
        return self.actor.act(torch.from_numpy(obs).float(), generator=self.gen,
                              std=torch.from_numpy(self.noise_std)).numpy()

    def episodes_ended(self, done: np.ndarray) -> None:
        self.noise_std = redraw_noise_std(self.noise_std, done, self.rng, self.args)

    def state(self) -> dict:
        """What an exact resume needs besides the envs (saved in collector snapshots)."""
        return {"rng": self.rng.bit_generator.state, "gen": self.gen.get_state(),
                "noise_std": self.noise_std}

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.gen.set_state(state["gen"])
        self.noise_std = state["noise_std"]


def draw_noise_std(rng: np.random.Generator, args: Args, n: int) -> np.ndarray:
    """Exploration std per env, uniform in [std_min, std_max]: some envs explore widely
    while others stay close to the policy."""
    return rng.uniform(args.std_min, args.std_max, size=(n, 1)).astype(np.float32)


def redraw_noise_std(noise_std: np.ndarray, done: np.ndarray, rng, args: Args) -> np.ndarray:
    """A new std for each env whose episode just ended; the others keep theirs."""
    if not done.any():
        return noise_std
    return np.where(done[:, None], draw_noise_std(rng, args, len(done)), noise_std)


# =======================================================================================
# Learner: losses and the update rule


class Learner:
    """Networks, optimizers and the update rule. The loop below the marker (`train`) uses
    only these: `actor` (the collectors and evaluations act with its weights; its normalizer
    takes in every new row), `device`, `num_updates`, `train_iteration`, `set_support`,
    `diagnostics`, STATE and FIXED: an idea that keeps them needs no edit below it."""

    # what a checkpoint holds (modules, optimizers, tensors), and the arguments a resumed
    # run must keep besides the loop's own (RESUME_FIXED): those that shape the networks
    STATE = ("actor", "critics", "critics_target", "actor_opt", "critic_opt")
    FIXED = ("actor_hidden", "critic_hidden", "num_atoms", "n_step", "v_min", "v_max")

    def __init__(self, args: Args, obs_dim, act_dim, low, high, device):
        self.args, self.device = args, device
        self.actor = make_actor(args, obs_dim, act_dim, low, high).to(device)
        self.critics = Critics(obs_dim, act_dim, args.critic_hidden, args.num_atoms,
                               args.v_min, args.v_max).to(device)
        self.critics_target = Critics(obs_dim, act_dim, args.critic_hidden, args.num_atoms,
                                      args.v_min, args.v_max).to(device)
        self.critics_target.load_state_dict(self.critics.state_dict())
        self.critics_target.requires_grad_(False)
        # one fused kernel per optimizer step: one launch on CUDA, and on CPU a third of the
        # time of the multi-tensor (foreach) step (about 140 against 440 us for the critics)
        adam = dict(betas=(0.9, 0.95), fused=True)
        self.actor_opt = torch.optim.AdamW(self.actor.parameters(), lr=args.actor_lr,
                                           weight_decay=args.weight_decay, **adam)
        self.critic_opt = torch.optim.AdamW(self.critics.parameters(), lr=args.critic_lr,
                                            weight_decay=args.weight_decay, **adam)
        self.online_params = list(self.critics.parameters())
        self.target_params = list(self.critics_target.parameters())
        self.num_updates = 0
        self.timeline = NO_TIMELINE  # (train sets it)
        self.critic_loss_fn, self.actor_loss_fn = self.critic_loss, self.actor_loss
        if args.compile:  # (static shapes: every mini-batch has the same size)
            how = compile_settings(args, device)
            self.critic_loss_fn = torch.compile(self.critic_loss, dynamic=False, **how)
            self.actor_loss_fn = torch.compile(self.actor_loss, dynamic=False, **how)
        # bf16 autocast; a disabled context costs nothing, so the code path is the same
        self.autocast = lambda: torch.autocast(device.type, torch.bfloat16, enabled=args.amp)

    def noise(self, rows: int) -> torch.Tensor:
        """Target policy smoothing's noise for `rows` samples, drawn eagerly and passed into
        the compiled loss: inductor's own CPU randn took 6% of fast_sac's update time
        (docs/performance.md). Compiled or not, a seed draws the same noise."""
        return torch.randn(rows, len(self.actor.scale), device=self.device)

    def critic_loss(self, obs, actions, rewards, next_obs, discounts, eps) -> torch.Tensor:
        args = self.args
        with torch.no_grad():
            # target policy smoothing: the next action gets clipped noise
            next_actions = self.actor.noisy(next_obs, eps * args.policy_noise, args.noise_clip)
            # (the critics' logits are float32 under --amp too: see Critics.forward)
            next_probs = self.critics_target(next_obs, next_actions).softmax(-1)
            support = self.critics_target.support  # next_probs: [2, B, N]
            if args.use_cdq:
                chosen = lower_mean_distribution(next_probs, support)  # clipped double Q
            else:
                chosen = next_probs.mean(0)
            target = project(chosen, rewards, discounts, support)
        log_probs = self.critics(obs, actions).log_softmax(-1)
        return -(target * log_probs).sum(-1).mean(-1).sum()

    def update_critic(self, obs, actions, rewards, next_obs, discounts) -> torch.Tensor:
        eps = self.noise(obs.shape[0])
        with self.autocast():
            loss = self.critic_loss_fn(obs, actions, rewards, next_obs, discounts, eps)
        self.critic_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.critic_opt.step()
        return loss.detach().clone()  # (a CUDA graph's output is overwritten at its replay)

    def actor_loss(self, obs) -> torch.Tensor:
        q = self.critics.q_values(obs, self.actor(obs))
        q = q.min(0).values if self.args.use_cdq else q.mean(0)
        return -q.mean()

    def update_actor(self, obs) -> torch.Tensor:
        self.critics.requires_grad_(False)
        with self.autocast():
            actor_loss = self.actor_loss_fn(obs)
        self.actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_opt.step()
        self.critics.requires_grad_(True)
        return actor_loss.detach().clone()  # (see update_critic)

    def train_iteration(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`updates_per_iter` updates on consecutive mini-batches of one large sample. The
        losses stay on the device, as tensors the caller reads only when it logs."""
        args = self.args
        norm, mark = self.actor.normalizer, self.timeline.now()
        obs, next_obs = norm(batch["obs"]), norm(batch["next_obs"])
        mark = self.timeline.phase("learner/normalize_batch", mark)
        qf_losses, actor_losses = [], []
        for start in range(0, obs.shape[0], args.batch_size):
            mb = slice(start, start + args.batch_size)  # (a view: no gather per update)
            qf_losses.append(self.update_critic(obs[mb], batch["actions"][mb],
                                                batch["rewards"][mb], next_obs[mb],
                                                batch["discounts"][mb]))
            mark = self.timeline.phase("learner/update_critic", mark)
            self.num_updates += 1
            if self.num_updates % args.policy_frequency == 0:
                actor_losses.append(self.update_actor(obs[mb]))
                mark = self.timeline.phase("learner/update_actor", mark)
            with torch.no_grad():  # else every lerp joins an ever-growing autograd graph
                torch._foreach_lerp_(self.target_params, self.online_params, args.tau)
            mark = self.timeline.phase("learner/target_update", mark)
        out = {"qf_loss": torch.stack(qf_losses).mean()}
        # the last update's gradient norms, once per iteration: its gradients are still
        # there (each update clears only its own networks' gradients, at its start)
        out["critic_grad_norm"] = grad_norm(self.online_params)
        if actor_losses:
            out["actor_loss"] = torch.stack(actor_losses).mean()
            out["qf_value"] = -out["actor_loss"]  # the actor's Q: how close to --v-max
            out["actor_grad_norm"] = grad_norm(self.actor.parameters())
        return out

    @torch.no_grad()
    def set_support(self, v_min: float, v_max: float) -> None:
        """Move the critics' atoms to [v_min, v_max], as the loop widens the range with the
        returns seen (ReturnRange: an env VALUE_RANGES lacks). The networks stay, so each
        atom's probability now stands for its new value (made on the device: no wait)."""
        for c in (self.critics, self.critics_target):
            c.support.copy_(torch.linspace(v_min, v_max, len(c.support), device=self.device))

    @torch.no_grad()
    def diagnostics(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logged with the losses, at the newest sample's raw `obs`: the spread of the
        policy's actions over the batch (in [-1, 1] box units, mean over the action
        dimensions) and the lowest and highest Q of both critics."""
        x = self.actor.normalizer(obs)
        actions = self.actor(x)
        q = self.critics.q_values(x, actions)
        spread = ((actions - self.actor.bias) / self.actor.scale).std(0).mean()
        return {"action_std": spread, "qf_min": q.min(), "qf_max": q.max()}


# =======================================================================================
# The training loop. Plumbing from here on: a new idea rarely needs a change below.


def train(args: Args, resume: dict | None = None, defaulted: frozenset = frozenset()) -> int:
    """Run one training job (continuing `resume`, a loaded checkpoint); returns the exit code.
    `defaulted`: the speed flags the user left to their default (see Run).

    Each iteration, in this order: wait until the chunk the schedule names is collected,
    fold its observations into the normalizer, sample and update, publish the actor's
    weights, log, evaluate and save when due. DESIGN.md explains the schedule.
    """
    stop = StopRequest()
    try:
        run = Run(args, defaulted, resume)
    except ArgsError as e:  # (--compile's warm-up failed, or the checkpoint does not fit)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    learner, loop, tally, timeline = run.learner, run.loop, run.tally, run.learner.timeline
    status, exit_code, message = "failed", 1, None
    try:
        collectors = start_collectors(run, resume)
        written, S, prefetched = loop["normalized_upto"], args.steps_per_iter, None
        while True:
            # wait for the rows this iteration trains on
            with timeline.span("learner/wait_for_data"):
                chunks, window = collectors.wait_for_chunk(loop["iteration"], written)
            if (lag := collectors.policy_lag(chunks - 1, loop["version"])) is not None:
                tally["lag"] += lag
                tally["lag_iterations"] += 1
            written, loop["global_step"] = chunks * S, chunks * S * args.num_envs
            done = chunks >= collectors.num_chunks
            stopping = stop.signum is not None and not done  # (a signal arrived)
            # a checkpoint holds the collectors' state at the start of the first chunk that
            # uses this iteration's weights: asked for before they are published
            snapshot = collectors.snapshot_chunk(chunks)
            save_now = (loop["global_step"] >= run.next_save or stopping) and not done
            if save_now and snapshot is not None:
                collectors.ask_snapshot(snapshot)

            # normalize, sample, update
            t0 = time.perf_counter()
            if written > loop["normalized_upto"]:
                fold_in_new_rows(run, written)
            if (loop["global_step"] >= args.learning_starts
                    and (written - loop["floor"]) * args.num_envs >= args.learning_starts):
                mark = timeline.now()
                batch = prefetched or run.sample(written, window, loop["floor"])
                run.last_obs = batch["obs"][:args.batch_size]  # (for diagnostics when logging)
                mark = timeline.phase("learner/replay_sample", mark, {"chunks": chunks})
                run.metrics = train_step(run, batch)  # on a GPU this returns at once
                mark, prefetched = timeline.now(), None
                if args.prefetch and not done and (nxt := collectors.next_chunk(chunks, window)):
                    prefetched = run.sample(nxt[0] * S, nxt[1], loop["floor"])
                    mark = timeline.phase("learner/prefetch", mark)
                check_finite(run.metrics, loop["global_step"], learner.num_updates)
                timeline.phase("learner/check_finite", mark)  # (on a GPU: waits for it)
                tally["first_update"] = tally["first_update"] or t0
                tally["last_update"] = time.perf_counter()
            tally["learn_s"] += time.perf_counter() - t0

            # publish the actor's weights
            t0, mark = time.perf_counter(), timeline.now()
            loop["version"] += 1
            collectors.ws.publish(learner.actor, loop["version"])
            loop["iteration"] += 1
            tally["sync_s"] += time.perf_counter() - t0
            timeline.phase("learner/weight_sync_write", mark)
            timeline.counter("weights_version", loop["version"])

            # log, evaluate, save
            log_iteration(run, done)
            if loop["global_step"] >= run.next_eval and not (done or stopping):
                evaluate_policy(run)
            if save_now:
                name = save_checkpoint(run, snapshot)
            if stopping:
                raise Interrupted(f"{name} written {time.perf_counter() - stop.t:.1f} s after "
                                  f"signal {stop.signum}")
            if done:
                break
        collectors.check()
        run.progress.bar.close()
        evaluate_policy(run, final=True)
        save_checkpoint(run, None, "model_final.pt")
        status, exit_code, message = "completed", 0, None
    except (Interrupted, KeyboardInterrupt) as e:  # (KeyboardInterrupt: a second signal)
        status, exit_code = "interrupted", 130
        message = (f"interrupted: {e}; stopping" if isinstance(e, Interrupted) else
                   "interrupted again: stopping without a checkpoint")
    except (CollectorError, Diverged) as e:
        status, message = "diverged" if isinstance(e, Diverged) else "failed", f"error: {e}"
    finally:
        finish_run(run, status, message)
    return exit_code


class Run:
    """One training job's parts and counters, which the loop's helpers share."""

    def __init__(self, args: Args, defaulted: frozenset = frozenset(),
                 resume: dict | None = None):
        """The learner (compiled and warmed up: a failure stops here, before any process or
        file exists, unless --compile was a default: then the run goes on eager), the run
        dir, TensorBoard, the progress line and --trace."""
        device, self.t_start = torch.device(args.device), time.time()
        if device.type == "cpu":
            torch.set_num_threads(args.learner_threads
                                  or default_learner_threads(args.num_collectors))
        else:
            torch.set_float32_matmul_precision("high")  # fp32 matmuls on tensor cores too
        torch.manual_seed(args.seed)
        self.args, self.learner = args, Learner(args, *env_dims(args.env), device)
        if resume is not None:  # (a checkpoint that does not fit is refused before it starts)
            checkpoints.check_fits(learner_state(self.learner), resume)
        compile_s = warm_up(self.learner, "compile" not in defaulted) if args.compile else 0.0
        if compile_s is None:  # the default fast path failed: the same run, eager
            args = self.args = dataclasses.replace(args, compile=False,
                                                   amp=args.amp and "amp" not in defaulted)
            torch.manual_seed(args.seed)
            self.learner = Learner(args, *env_dims(args.env), device)
        self.run_dir = args.run_dir or (f"runs/{args.env}__{SCRIPT}__{args.seed}__"
                                        f"{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(self.run_dir, exist_ok=True)
        self.writer = make_writer(args, self.run_dir, resume and resume["global_step"])
        self.progress = Progress(args, f" | compiled in {compile_s:.0f}s" if compile_s else "")
        # --trace: this process's timeline and its collectors' (NO_TIMELINE: records nothing)
        self.trace = Trace(args.trace_events, cuda=device.type == "cuda") if args.trace else None
        self.learner.timeline = self.trace.learner if self.trace else NO_TIMELINE
        self.rng = np.random.default_rng(args.seed)  # the replay sampler's
        # the critics' support follows the returns seen (an env VALUE_RANGES lacks)
        self.value_range = ReturnRange(args.num_envs, args.gamma) if args.v_min is None else None
        self.collectors: Collectors | None = None
        # --cudagraphs: the learner's iteration captured and replayed (see train_step)
        self.graph = IterationGraph(lambda batch: graphed_iteration(self.learner, batch),
                                    self.learner, self.learner.STATE,
                                    device) if args.cudagraphs else None
        self.sample: Sampler | Mirror | None = None
        # what a checkpoint carries besides the networks to continue the loop exactly; floor:
        # env-local steps below it hold no data (after a resume without the replay file)
        self.loop = dict(iteration=0, version=0, normalized_upto=0, floor=0, global_step=0)
        # episode ends by cause, the policy lag (summed over iterations), the learner's
        # seconds by cause and when it updated first and last; `logged`: the same at the
        # last progress line
        self.tally = dict.fromkeys(("terminated", "truncated", "lag", "lag_iterations",
                                    "learn_s", "sync_s", "first_update", "last_update"), 0)
        self.logged = dict(self.tally)
        self.metrics = self.last_obs = None  # the newest iteration's losses and observations
        self.next_save = self.next_eval = math.inf
        self.final_eval = None
        self.start = (0, 0)  # the env step and update this process began at (for its rates)


def start_collectors(run: Run, resume: dict | None) -> Collectors:
    """Create the shared memory, load `resume`, publish the first weights and start the
    collectors."""
    args, learner = run.args, run.learner
    obs_dim, act_dim, low, high = env_dims(args.env)
    run.collectors = Collectors.create(SCRIPT, args, run.run_dir,
                                       make_actor(args, obs_dim, act_dim, low, high),
                                       obs_dim, act_dim)
    starts = restore(resume, run) if resume is not None else [None] * args.num_collectors
    run.collectors.ws.publish(learner.actor, run.loop["version"])
    run.collectors.start(make_env, Explorer, starts)
    sampling = (run.collectors.rb, run.rng, learner.device,
                args.batch_size * args.updates_per_iter, args.n_step, args.gamma)
    run.sample = (Mirror(*sampling, timeline=learner.timeline) if args.replay_mirror else
                  Sampler(*sampling, pinned=args.prefetch, timeline=learner.timeline))
    run.next_save = next_multiple(run.loop["global_step"], args.save_interval)
    run.next_eval = next_multiple(run.loop["global_step"], args.eval_interval)
    return run.collectors


def fold_in_new_rows(run: Run, written: int) -> None:
    """The new rows' observations into the normalizer (and, with ReturnRange, their rewards
    into the critics' support)."""
    loop, rb, mark = run.loop, run.collectors.rb, run.learner.timeline.now()
    first = max(loop["normalized_upto"], written - rb.capacity, loop["floor"])
    # (a pageable copy, but the GPU is idle here: the last iteration ended reading its
    # losses and weights back, so it waits for nothing)
    new_obs = torch.from_numpy(rb.rows(first, written)).to(run.learner.device)
    run.learner.actor.normalizer.update(new_obs)
    if run.value_range is not None:
        idx = np.arange(first, written) % rb.capacity
        run.value_range.update(rb.rewards[:, idx], rb.dones[:, idx])
        if (support := run.value_range.changed_support()) is not None:
            run.learner.set_support(*support)
    loop["normalized_upto"] = written
    run.learner.timeline.phase("learner/normalizer_update", mark)


class ReturnRange:
    """The critics' support on an env that VALUE_RANGES lacks (without --v-min/--v-max): it
    follows G <- reward + gamma * G, each env's discounted sum of its episode's rewards so
    far, which spans what the values span. The support covers the lowest and highest G seen
    and 0, widened by a quarter of that width below and by half above (an improving policy's
    values lie above the returns collected so far); set before the first update, it widens
    as new rows arrive."""

    def __init__(self, num_envs: int, gamma: float):
        self.gamma, self.g, self.lo, self.hi = gamma, np.zeros(num_envs), 0.0, 0.0
        self.applied = None  # the support last handed to the critics

    def update(self, rewards: np.ndarray, dones: np.ndarray) -> None:
        """Fold in rewards and episode ends, [num_envs, steps] in the order collected."""
        for t in range(rewards.shape[1]):
            self.g = rewards[:, t] + self.gamma * self.g
            self.lo, self.hi = min(self.lo, float(self.g.min())), max(self.hi, float(self.g.max()))
            self.g = self.g * (1.0 - dones[:, t])

    def support(self) -> tuple[float, float]:
        width = max(self.hi - self.lo, 1e-3)
        return self.lo - width / 4, self.hi + width / 2

    def changed_support(self) -> tuple[float, float] | None:
        """The support, if it differs from the one last returned here; else None."""
        support = self.support()
        if support == self.applied:
            return None
        self.applied = support
        return support

    def state(self) -> dict:
        return {"g": self.g.copy(), "lo": self.lo, "hi": self.hi}

    def load(self, state: dict, episodes_continue: bool) -> None:
        """Restore a checkpoint's range; the running sums only when the collectors continue
        their episodes (from their snapshots, with or without the replay file)."""
        self.lo, self.hi = state["lo"], state["hi"]
        if episodes_continue:
            self.g = state["g"].copy()


def train_step(run: Run, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The learner's iteration; with --cudagraphs its graph, replayed (common/graph.py): one
    per turn of the actor's updates within an iteration (policy_frequency), whose updates
    are counted here. A capture that fails says why in one line, and the run goes on eager."""
    learner, args = run.learner, run.args
    if run.graph is None:
        return learner.train_iteration(batch)
    n, mark = learner.num_updates, learner.timeline.now()
    try:
        metrics = run.graph(n % args.policy_frequency, batch)
    except Exception as e:
        print(f"warning: --cudagraphs failed ({type(e).__name__}: "
              f"{(str(e).strip().splitlines() or [''])[0][:200]}); going on eager",
              file=sys.stderr, flush=True)
        run.graph = None
        return learner.train_iteration(batch)
    learner.num_updates = n + args.updates_per_iter
    learner.timeline.phase("learner/graph_replay", mark)
    return metrics


def graphed_iteration(learner: Learner, batch: dict[str, torch.Tensor]) -> dict:
    """train_iteration as a graph records it: a run that leaves the update count as it was
    (train_step counts a replay's updates), so that every run starts at the same turn."""
    n = learner.num_updates
    try:
        return learner.train_iteration(batch)
    finally:
        learner.num_updates = n


def log_iteration(run: Run, done: bool) -> None:
    """Episodes as they finish, losses every 10 iterations, rates when progress is due."""
    writer, learner, tally, timeline = run.writer, run.learner, run.tally, run.learner.timeline
    step, mark, collectors = run.loop["global_step"], timeline.now(), run.collectors
    for ret, length, at, terminated, *term_sums in collectors.new_episodes():
        writer.add_scalar("charts/episodic_return", ret, int(at))
        writer.add_scalar("charts/episodic_length", length, int(at))
        for name, value in zip(collectors.reward_terms, term_sums):
            writer.add_scalar(f"charts/episodic_{name}", value, int(at))
        tally["terminated" if terminated else "truncated"] += 1
        run.progress.recent.append(ret)
    if run.metrics is not None and (run.loop["iteration"] % 10 == 0 or done):
        metrics = run.metrics | learner.diagnostics(run.last_obs)
        for k, v in zip(metrics, torch.stack(list(metrics.values())).tolist()):
            writer.add_scalar(f"losses/{k}", v, step)
        if run.trace:  # (one device sync, only now)
            run.trace.resolve_device()
    if run.trace:
        collectors.drain_trace(run.trace)
        timeline.counter("replay_rows", step)
    if run.progress.due() or done:
        new = {k: tally[k] - run.logged[k] for k in tally}  # since the last progress line
        timing = collectors.ctrl.mean_timing()  # (the collectors' cumulative seconds)
        scalars = {"charts/SPS": int((step - run.start[0]) / (time.time() - run.t_start)),
                   "charts/update_to_data": learner.num_updates / max(step, 1),
                   "charts/replay_ratio": replay_ratio(run),
                   "perf/collect_time": timing[COLLECT_S],
                   "perf/collector_weight_wait": timing[WEIGHT_WAIT_S],
                   "perf/collector_weight_load": timing[WEIGHT_LOAD_S],
                   **{f"perf/{k.removesuffix('_s')}_time": v for k, v in timers(run).items()}}
        if ended := new["terminated"] + new["truncated"]:
            scalars["charts/terminated_rate"] = new["terminated"] / ended
            scalars["charts/truncated_rate"] = new["truncated"] / ended
        if new["lag_iterations"]:
            scalars["charts/policy_lag"] = new["lag"] / new["lag_iterations"]
        if run.value_range is not None:
            scalars |= dict(zip(("charts/v_min", "charts/v_max"), run.value_range.support()))
        scalars["perf/updates_per_sec"] = run.progress.show(step, time.time() - run.t_start,
                                                            learner.num_updates)
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        run.logged = dict(tally)
    timeline.phase("learner/log", mark)


def timers(run: Run) -> dict[str, float]:
    """The learner's seconds by cause: waiting for collectors, learning, sampling, weights."""
    return {"wait_s": run.collectors.wait_s if run.collectors else 0.0,
            "learn_s": run.tally["learn_s"], "sample_s": run.sample.seconds if run.sample else 0,
            "sync_s": run.tally["sync_s"]}


def replay_ratio(run: Run) -> float:
    """Transitions sampled per transition collected."""
    return run.learner.num_updates * run.args.batch_size / max(run.loop["global_step"], 1)


def evaluate_policy(run: Run, final: bool = False) -> None:
    """Deterministic episodes on a separate env (and a video with --capture-video)."""
    args, step, mark = run.args, run.loop["global_step"], run.learner.timeline.now()
    actor, device = run.learner.actor, run.learner.device
    returns = evaluate(actor, args.env, args.eval_episodes, args.seed, device)
    run.writer.add_scalar("eval/episodic_return", returns.mean(), step)
    if args.capture_video:
        record_video(actor, args, device, run.run_dir, step)
    if final:
        run.final_eval = float(returns.mean())
    else:
        run.next_eval = next_multiple(step, args.eval_interval)
    run.progress.bar.write(f"{'final eval' if final else f'eval at step {step:,}'}: return "
                           f"{returns.mean():.1f} +- {returns.std():.1f}")
    run.learner.timeline.phase("learner/evaluate", mark)


def finish_run(run: Run, status: str, message: str | None) -> None:
    """Print how the run ended, write the trace, stop the collectors, remove the shared
    memory, and write summary.json: the run's counts and rates (each over the time its part
    was busy)."""
    run.progress.bar.close()
    if message:
        print(message, file=sys.stderr, flush=True)
    try:  # (a trace that cannot be written must not keep the collectors running)
        write_trace(run)
    except Exception as e:
        print(f"warning: --trace: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if run.collectors is not None:
        run.collectors.close()
    run.writer.close()
    loop, updates, tally = run.loop, run.learner.num_updates, run.tally
    collect_s = float(run.collectors.timing[COLLECT_S]) if run.collectors else 0.0

    def rate(n, seconds):
        return round(n / seconds, 1) if seconds else None

    summary = {
        "status": status, "env_id": run.args.env, "sync_mode": run.args.sync_mode,
        "total_env_steps": loop["global_step"], "num_updates": updates,
        "iterations": loop["iteration"], "wall_time_s": round(time.time() - run.t_start, 2),
        "final_eval_return": run.final_eval, "device": run.args.device, "seed": run.args.seed,
        "perf": {"collect_s": round(collect_s, 3),
                 **{k: round(v, 3) for k, v in timers(run).items()},
                 "collector_steps_per_s": rate(loop["global_step"] - run.start[0], collect_s),
                 "learner_updates_per_s": rate(updates - run.start[1], tally["learn_s"]),
                 "updates_per_s_since_first_update": rate(
                     updates - run.start[1], tally["last_update"] - tally["first_update"])},
        "collector_restarts": run.collectors.restarts if run.collectors else 0,
        "episodes_terminated": tally["terminated"], "episodes_truncated": tally["truncated"],
        "replay_ratio": round(replay_ratio(run), 3),
        "policy_lag": (round(tally["lag"] / tally["lag_iterations"], 3)
                       if tally["lag_iterations"] else None)}
    with open(os.path.join(run.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def write_trace(run: Run) -> None:
    """--trace: the timeline so far, to {run_dir}/trace.json."""
    if run.trace is not None and run.collectors is not None:
        run.collectors.drain_trace(run.trace)
        run.trace.write(os.path.join(run.run_dir, "trace.json"),
                        {"script": SCRIPT, "sync_mode": run.args.sync_mode})


class Diverged(RuntimeError):
    pass


def check_finite(metrics: dict[str, torch.Tensor], global_step: int, num_updates: int,
                 agree=bool) -> None:
    """Stop on a non-finite loss (one host sync per iteration, outside the update loop);
    `agree` makes several learner ranks stop together."""
    values = torch.stack(list(metrics.values()))
    if agree(not bool(torch.isfinite(values).all())):
        bad = {k: v for k, v in zip(metrics, values.tolist()) if not math.isfinite(v)}
        bad = bad or "on another rank"
        raise Diverged(f"non-finite loss {bad} at env step {global_step} (update {num_updates});"
                       " the last good checkpoint is kept. Lower the learning rates or check "
                       "the env's rewards and --v-min/--v-max")


def next_multiple(step: int, interval: int) -> float:
    """The first multiple of `interval` above `step` (inf when interval is 0: never)."""
    return (step // interval + 1) * interval if interval else math.inf


def grad_norm(params) -> torch.Tensor:
    """The gradients' total 2-norm, on the device (read only when logging is due)."""
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def warm_up(learner: Learner, asked: bool = True) -> float | None:
    """--compile: compile both update steps now by running them once on made-up data, so
    that a compile error shows in the run's first seconds, before any process starts: an
    ArgsError if the user `asked` for --compile, else a warning and None (the caller goes
    on eager). The networks, optimizers, counters and random state are put back afterwards.
    Returns the seconds it took (inductor caches the compiled code, by default in
    /tmp/torchinductor_$USER: later runs take seconds)."""
    t0, saved = time.perf_counter(), copy.deepcopy(learner_state(learner))
    cuda = learner.device.type == "cuda"
    rows = learner.args.batch_size * learner.args.policy_frequency  # (the actor's turn too)
    shapes = batch_shapes(rows, learner.actor.normalizer.mean.shape[0], len(learner.actor.scale))
    try:
        with torch.random.fork_rng([learner.device] if cuda else []):  # (puts the RNG back)
            learner.train_iteration({k: torch.zeros(shape, device=learner.device)
                                     for k, shape in shapes.items()})
            if cuda:
                torch.cuda.synchronize(learner.device)
    except Exception as e:
        why = (f"--compile failed in the warm-up update ({type(e).__name__}: "
               f"{(str(e).strip().splitlines() or [''])[0][:300]})")
        if asked:
            raise ArgsError(f"{why}; run with --compile False") from e
        print(f"warning: {why}; going on without --compile and --amp", file=sys.stderr)
        return None
    load_learner(learner, saved)
    return time.perf_counter() - t0


def compile_settings(args: Args, device: torch.device) -> dict:
    """torch.compile's options: on a CPU, inductor's C++ wrapper, which calls the kernels
    from C++ (1.06x the updates/s, docs/performance.md), where Python's headers are there:
    it builds each graph as an extension module."""
    headers = os.path.exists(os.path.join(sysconfig.get_path("include"), "Python.h"))
    return {"options": {"cpp_wrapper": device.type == "cpu" and headers}}


# =======================================================================================
# Logging and evaluation


def make_writer(args: Args, run_dir: str, start: int = 0):
    """TensorBoard (and wandb with --track), with the arguments as a text table. A resumed
    run (from env step `start`) hides the events its failed run wrote after that step."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(run_dir, purge_step=start or None)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project, config=vars(args), sync_tensorboard=True,
                   name=os.path.basename(run_dir), dir=run_dir)
    return writer


class Progress:
    """tqdm's bar on a terminal; otherwise a line every --log-interval seconds (a log file
    gets lines, not a bar's carriage returns); --quiet: evaluations and errors only."""

    def __init__(self, args: Args, note: str = ""):
        from tqdm import tqdm

        self.bar = tqdm(total=args.total_timesteps, unit="step", dynamic_ncols=True,
                        disable=args.quiet or not sys.stdout.isatty())
        self.lines = self.bar.disable and not args.quiet
        self.interval = args.log_interval if self.bar.disable else 0.5
        self.recent = collections.deque(maxlen=20)  # the newest episodes' returns
        self.last = time.perf_counter(), 0, 0  # (time, env step, updates) at the last line
        self.note = note  # shown on the first line (the compile time)

    def due(self) -> bool:
        return time.perf_counter() - self.last[0] >= self.interval

    def show(self, step: int, elapsed: float, updates: int) -> float:
        """The rates since the last line; returns updates/s."""
        (t, step_last, updates_last), now = self.last, time.perf_counter()
        sps, ups = (step - step_last) / (now - t), (updates - updates_last) / (now - t)
        ret = f"{np.mean(self.recent):9.1f}" if self.recent else "      n/a"
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(f"SPS {sps:.0f} | updates/s {ups:.1f} | return {ret.strip()}"
                                 + self.note)
        if self.lines:
            print(f"step {step:>9,} | {elapsed:7.1f}s | SPS {sps:7.0f} | updates/s {ups:6.1f} | "
                  f"updates {updates:>8,} | return {ret}{self.note}", flush=True)
        self.last, self.note = (now, step, updates), ""
        return ups


@torch.no_grad()
def evaluate(actor: Actor, env_id: str, episodes: int, seed: int, device) -> np.ndarray:
    """Returns of `episodes` deterministic episodes, run side by side on a separate env."""
    envs = gym.make_vec(env_id, num_envs=episodes, vectorization_mode="sync")
    obs, _ = envs.reset(seed=[seed + 777_777 + i for i in range(episodes)])
    returns, running = np.zeros(episodes), np.ones(episodes, dtype=bool)
    while running.any():
        action = actor.act(torch.as_tensor(obs, dtype=torch.float32, device=device), True)
        obs, reward, terminated, truncated, _ = envs.step(action.cpu().numpy())
        returns += reward * running
        running &= ~(terminated | truncated)
    envs.close()
    return returns


def record_video(actor: Actor, args: Args, device, run_dir: str, global_step: int) -> None:
    """--capture-video: one deterministic episode to videos/step_N.mp4 (a GIF without
    imageio-ffmpeg). A machine that cannot render gets a warning, not a failed run."""
    import imageio.v2 as imageio

    path = os.path.join(run_dir, "videos", f"step_{global_step}")
    try:
        env = gym.make(args.env, render_mode="rgb_array", width=256, height=256)
        obs, _ = env.reset(seed=args.seed + 777_777)
        frames, done = [env.render()], False
        while not done:
            x = torch.as_tensor(obs[None], dtype=torch.float32, device=device)
            obs, _, terminated, truncated, _ = env.step(actor.act(x, True)[0].cpu().numpy())
            frames.append(env.render())
            done = terminated or truncated
        fps = env.metadata.get("render_fps") or 30
        env.close()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            imageio.mimsave(path + ".mp4", frames, fps=fps)
        except (ImportError, ValueError, RuntimeError):  # no ffmpeg plugin: a GIF
            imageio.mimsave(path + ".gif", frames, duration=1000 / fps, loop=0)
    except Exception as e:  # no OpenGL, an env that cannot render
        print(f"warning: --capture-video failed ({type(e).__name__}: {e}); set MUJOCO_GL=egl "
              "or osmesa", file=sys.stderr, flush=True)


# =======================================================================================
# Checkpoints and resume (common/checkpoints.py keeps the files)

# the loop's own arguments that a resumed run must keep (with Learner.FIXED), and those
# resolved again for the machine it continues on
RESUME_FIXED = ("num_envs", "num_collectors", "buffer_size", "steps_per_iter", "sync_mode")
MACHINE = ("device", "compile", "amp", "prefetch", "replay_mirror", "cudagraphs",
           "learner_threads")


def learner_state(learner: Learner) -> dict:
    """What a checkpoint holds of the learner: Learner.STATE and the update count."""
    return checkpoints.state_of(learner, learner.STATE) | {"num_updates": learner.num_updates}


def load_learner(learner: Learner, state: dict) -> None:
    checkpoints.load_into(learner, learner.STATE, state)
    learner.num_updates = state["num_updates"]


def all_finite(learner: Learner) -> bool:
    """Whether every tensor an optimizer updates is finite (checked before a save)."""
    tensors = [p for opt in checkpoints.optimizers(learner, learner.STATE)
               for group in opt.param_groups for p in group["params"]]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def save_checkpoint(run: Run, snapshot: int | None, name: str | None = None) -> str:
    """Networks, optimizers, counters and RNG (its name: checkpoint_{step}.pt by default);
    with the collectors' snapshot at chunk `snapshot` (and the replay, with --save-replay)
    a resumed run continues exactly."""
    mark, step = run.learner.timeline.now(), run.loop["global_step"]
    name = name or f"checkpoint_{step}.pt"
    collector_state = run.collectors.snapshots() if snapshot is not None else None
    if not all_finite(run.learner):
        raise Diverged(f"non-finite parameters at env step {step}; the last good checkpoint "
                       "is kept")
    state = learner_state(run.learner) | {
        "args": dataclasses.asdict(run.args), "script": SCRIPT, **run.loop,
        "restarts": run.collectors.restarts, "rng": run.rng.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "collector": collector_state, "replay": None,
        "value_range": run.value_range and run.value_range.state()}
    if collector_state is not None and run.args.save_replay:
        state["replay"] = name.removesuffix(".pt") + ".replay.npz"
        run.collectors.rb.save(os.path.join(run.run_dir, state["replay"]),
                               collector_state[0]["chunk"] * run.args.steps_per_iter)
    checkpoints.save(state, run.run_dir, name, run.args.keep_checkpoints)
    run.next_save = next_multiple(step, run.args.save_interval)
    run.learner.timeline.phase("learner/checkpoint", mark)
    write_trace(run)  # (an interrupted run keeps the timeline up to here)
    return name


def restore(ckpt: dict, run: Run) -> list[dict]:
    """Load a checkpoint into the learner and the buffers; returns the collectors' starts."""
    load_learner(run.learner, ckpt)
    run.rng.bit_generator.state = ckpt["rng"]
    torch.set_rng_state(ckpt["torch_rng"])
    if ckpt.get("cuda_rng") and run.learner.device.type == "cuda":
        with contextlib.suppress(RuntimeError):  # (another number of GPUs: fresh noise)
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
    loop = run.loop
    loop.update({k: ckpt[k] for k in loop if k in ckpt})
    if run.value_range is not None and ckpt.get("value_range"):
        run.value_range.load(ckpt["value_range"], ckpt["collector"] is not None)
    print(f"resuming {ckpt['path']} at env step {loop['global_step']:,}", flush=True)
    run.start = loop["global_step"], run.learner.num_updates  # (rates count from here)
    run.progress.last = time.perf_counter(), *run.start
    starts, floor = run.collectors.resume(ckpt)
    if floor is not None:  # no replay file: the buffer refills before updates go on
        loop["floor"], loop["normalized_upto"] = floor, max(loop["normalized_upto"], floor)
    return starts


def evaluate_checkpoint(args: Args) -> int:
    """--eval-only: mean and std of the return of a saved policy."""
    if not args.checkpoint:
        raise ArgsError("--eval-only needs --checkpoint PATH (a .pt file or run dir)")
    ckpt = checkpoints.find(args.checkpoint, SCRIPT)
    saved = checkpoints.saved_args(Args, ckpt)
    actor = make_actor(saved, *env_dims(saved.env))
    checkpoints.check_fits({"actor": actor.state_dict()}, ckpt)
    actor.load_state_dict(ckpt["actor"])
    returns = evaluate(actor, saved.env, args.eval_episodes, args.seed, "cpu")
    print(f"{saved.env}: return {returns.mean():.1f} +- {returns.std():.1f} over "
          f"{args.eval_episodes} deterministic episodes ({ckpt['path']})")
    return 0


# =======================================================================================
# Arguments: the recipe's defaults and the checks (all before any process starts); main


def resolve_args(args: Args, check_shm: bool = True) -> Args:
    """Fill the recipe's defaults for the learner's device and the env family, then check
    everything; raise ArgsError. (check_shm=False: for callers that create no buffers.)"""
    env_id = resolve_env_id(args.env)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgsError("--device cuda was asked for but torch sees no CUDA device; "
                        "use --device cpu (or auto)")
    device = "cuda" if args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu"
    family = env_id.split("-v")[0]
    recipe = GPU_RECIPE if device == "cuda" else dict(CPU_RECIPE, **CPU_FAMILY.get(family, {}))
    lr = LEARNING_RATE.get(family, DEFAULT_LEARNING_RATE)  # (a given --actor-lr/--critic-lr wins)
    filled = {k: (v if getattr(args, k) is None else getattr(args, k))
              for k, v in dict(recipe, actor_lr=lr, critic_lr=lr).items()}
    if (args.v_min is None) != (args.v_max is None) and family not in VALUE_RANGES:
        raise ArgsError(f"{env_id} has no value range in VALUE_RANGES: give both --v-min and "
                        "--v-max, or neither (the critics' support then follows the returns "
                        "seen)")
    v_min, v_max = VALUE_RANGES.get(family, (None, None))  # (None: see ReturnRange)
    args = dataclasses.replace(args, env=env_id, device=device, **filled,
                               v_min=v_min if args.v_min is None else args.v_min,
                               v_max=v_max if args.v_max is None else args.v_max)
    for flag in ("compile", "amp", "prefetch", "replay_mirror"):
        if getattr(args, flag) is None:
            setattr(args, flag, device == "cuda")
    if args.num_collectors is None:
        args.num_collectors = default_num_collectors(device, args.num_envs)
    check_args(args, check_shm)
    return args


def fast_path_default(args: Args) -> tuple[bool, str]:
    """--compile and --amp stay off on a CPU learner: fast_td3 compiled in bf16 did not stand
    on Humanoid more often than eager (docs/performance.md, "The defaults on a CPU")."""
    return False, "fast_td3 keeps eager float32 on a CPU"


def settings_line(args: Args, defaulted: frozenset) -> str:
    """What was resolved for this machine, and why the speed path; printed at the start."""
    why = ("given" if "compile" not in defaulted else "CUDA" if args.device == "cuda"
           else fast_path_default(args)[1])
    threads = args.learner_threads or default_learner_threads(args.num_collectors)
    return (f"{SCRIPT} on {args.device} ({available_cores()} cores): {args.num_envs} envs in "
            f"{args.num_collectors} collector(s), batch {args.batch_size} x "
            f"{args.updates_per_iter} updates per {args.steps_per_iter} steps of each env, actor "
            f"{args.actor_hidden}, critics {args.critic_hidden}, "
            + (f"{threads} learner thread(s), " if args.device == "cpu" else "")
            + f"{'compiled' if args.compile else 'eager'} {'bf16' if args.amp else 'float32'} "
            f"({why}), prefetch {args.prefetch}, replay mirror {args.replay_mirror}")

def resolve_env_id(name: str) -> str:
    """A registered id as given, or the newest version of a short name (Humanoid -> -v5)."""
    if name in gym.registry:
        return name
    versions = [(int(m.group(1)), k) for k in gym.registry
                if (m := re.fullmatch(re.escape(name) + r"-v(\d+)", k))]
    if versions:
        return max(versions)[1]
    close = difflib.get_close_matches(name, list(gym.registry), n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise ArgsError(f"unknown environment '{name}'.{hint}")


def check_args(args: Args, check_shm: bool = True) -> None:
    """Raise ArgsError, with the fix, for input that would fail later or silently."""
    for name in ("total_timesteps", "num_envs", "buffer_size", "batch_size", "steps_per_iter",
                 "updates_per_iter", "actor_hidden", "critic_hidden", "policy_frequency",
                 "n_step", "num_atoms", "eval_episodes", "keep_checkpoints", "trace_events",
                 "learning_starts", "save_interval", "eval_interval"):
        low = 2 if name == "trace_events" else 0 if name.endswith(("starts", "interval")) else 1
        if getattr(args, name) < low:
            raise ArgsError(f"--{name.replace('_', '-')} must be "
                            f"{'positive' if low == 1 else f'at least {low}'}, "
                            f"got {getattr(args, name)}")
    if args.cudagraphs and args.device == "cpu" and args.compile:
        raise ArgsError("--cudagraphs on a CPU is a stand-in that replays eager ops (for "
                        "tests): add --compile False")
    if not 1 <= args.num_collectors <= args.num_envs:
        raise ArgsError(f"--num-collectors must lie in [1, --num-envs ({args.num_envs})], got "
                        f"{args.num_collectors}: each collector steps at least one env")
    if not 0 < args.gamma <= 1 or not 0 < args.tau <= 1:
        raise ArgsError("--gamma and --tau must lie in (0, 1]")
    if not 0 <= args.std_min <= args.std_max:
        raise ArgsError(f"need 0 <= --std-min <= --std-max, got {args.std_min}, {args.std_max}")
    if args.v_min is not None and args.v_min >= args.v_max:
        raise ArgsError(f"--v-min ({args.v_min}) must be below --v-max ({args.v_max})")
    if args.learning_starts >= args.total_timesteps:
        raise ArgsError(f"--learning-starts ({args.learning_starts}) must be below "
                        f"--total-timesteps ({args.total_timesteps}), or nothing is learned")
    for flag, package in (("track", "wandb"), ("capture_video", "imageio")):
        if getattr(args, flag) and importlib.util.find_spec(package) is None:
            raise ArgsError(f"--{flag.replace('_', '-')} needs the {package} package: "
                            f"pip install {package}")
    env = gym.make(args.env)
    space, obs_space = env.action_space, env.observation_space
    env.close()
    if not isinstance(space, gym.spaces.Box) or not np.isfinite([space.low, space.high]).all():
        raise ArgsError(f"{args.env} has a {type(space).__name__} action space; {SCRIPT} needs "
                        "continuous (Box) actions with finite bounds")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        raise ArgsError(f"{args.env} must have a flat Box observation space, got {obs_space}")
    check_sizes(args, obs_space.shape[0], space.shape[0], check_shm)  # shared memory, disk


def main(argv=None) -> int:
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    args, resume = tyro.cli(Args, args=argv), None
    if args.capture_video:  # offscreen MuJoCo rendering without a display
        os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        if args.eval_only:
            return evaluate_checkpoint(args)
        if args.resume:
            args, resume = checkpoints.resume(args, argv, SCRIPT, RESUME_FIXED + Learner.FIXED,
                                              MACHINE)
        if resume and resolve_env_id(args.env) != resume["args"]["env"]:
            raise ArgsError(f"{resume['path']} was trained on {resume['args']['env']}, not "
                            f"{args.env}")
        if resume and resume["global_step"] >= args.total_timesteps:
            print(f"the checkpoint has {resume['global_step']:,} env steps already "
                  f"(--total-timesteps {args.total_timesteps:,}): nothing to do")
            return 0
        defaulted = frozenset(f for f in ("compile", "amp") if getattr(args, f) is None)
        args = resolve_args(args)
    except ArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(settings_line(args, defaulted), flush=True)
    return train(args, resume, defaulted)


if __name__ == "__main__":
    sys.exit(main())
