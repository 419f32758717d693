"""FastSAC: Soft Actor-Critic with distributional critics, fed by asynchronous CPU collectors.

    python fast_sac.py --env Humanoid
    python fast_sac.py --env HalfCheetah --sync-mode lockstep --total-timesteps 200000

This process is the learner (on the GPU when there is one). Collector subprocesses (CPU)
step the envs and write transitions into a replay buffer in shared memory; the learner
samples it, trains, and publishes the actor's weights back through shared memory.

Read top to bottom: Args -> recipe and checks -> env -> networks -> how a collector acts
-> Learner (losses, update rule) -> the training loop -> checkpoints -> main. To try an
idea, copy this file and edit the first part; the plumbing below "the training loop" rarely
needs a change. common/ moves the bytes between processes; DESIGN.md explains how.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.collectors import CollectorError, Collectors, async_window_chunks
from common.control import COLLECT_S, WEIGHT_LOAD_S, WEIGHT_WAIT_S
from common.replay import Mirror, ReplayBuffer, Sampler, batch_nbytes, batch_shapes
from common.shm import check_shm_space
from common.trace import NO_TIMELINE, Trace

SCRIPT = Path(__file__).stem  # names runs, checkpoints and processes: copies need no edit


# =======================================================================================
# Arguments: the algorithm's first, then sizes, then how the run is kept


@dataclass
class Args:
    env: str = "Humanoid"
    """gymnasium id; a short name such as Humanoid resolves to the newest version (Humanoid-v5)"""
    seed: int = 1
    """seed of networks, sampling, exploration and environments"""
    total_timesteps: int = 1_000_000
    """environment steps to collect, summed over all envs"""

    # algorithm
    policy_frequency: int = 2
    """critic updates per actor (and temperature) update"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.01
    """soft target update rate: target <- target + tau * (online - target)"""
    n_step: int | None = None
    """n-step returns; sums stop at episode ends. None: per env family, 3 on Hopper and
    Walker2d, 1 elsewhere (N_STEP; README: Recipe choices)"""
    actor_lr: float = 3e-4
    """actor learning rate (AdamW)"""
    critic_lr: float = 3e-4
    """critic learning rate (AdamW)"""
    alpha_lr: float = 3e-4
    """temperature learning rate"""
    weight_decay: float = 0.001
    """AdamW weight decay of actor and critics"""
    alpha_init: float = 0.1
    """initial entropy temperature"""
    target_entropy: float | None = None
    """entropy the temperature steers the policy towards, in nats per action dimension with
    the actions measured in the [-1, 1] box, so that it means the same on every action
    range (a uniform policy has 0.69); None: per env family, -0.5 but 0.42 on the
    Humanoids (TARGET_ENTROPY; README: Entropy target)"""
    log_std_min: float = -5.0
    """lower bound of the actor's log standard deviation"""
    log_std_max: float = 1.0
    """upper bound of the actor's log standard deviation"""
    use_cdq: bool = True
    """clipped double Q: the target and the actor's objective use the critic with the lower
    value; off: the average of both critics (distributions for the target)"""
    num_atoms: int = 101
    """atoms of the distributional (C51) critics"""
    v_min: float | None = None
    """lowest value of the critics' support (default: per env family, see VALUE_RANGES; an
    env the table lacks: it follows the returns seen, see ReturnRange)"""
    v_max: float | None = None
    """highest value of the critics' support (default: like --v-min)"""

    # sizes; None means the recipe default for the learner's device (see README)
    num_envs: int | None = None
    """parallel environments, all collectors together (default 8 on CPU, 32 on GPU)"""
    num_collectors: int | None = None
    """collector subprocesses, each stepping its own slice of the envs (default: see
    default_num_collectors; 1 on a CPU machine of up to 4 cores)"""
    buffer_size: int | None = None
    """replay capacity in transitions, all envs together (default 1M)"""
    batch_size: int | None = None
    """transitions per gradient update (default 256 on CPU, 4096 on GPU)"""
    learning_starts: int | None = None
    """environment steps of uniform random actions before the first update (default 5000)"""
    steps_per_iter: int | None = None
    """environment steps per env between learner iterations (default 8)"""
    updates_per_iter: int | None = None
    """gradient updates per learner iteration (default 8 on CPU, 32 on GPU)"""
    actor_hidden: int | None = None
    """width of the actor's first layer; later layers halve it (default 256 CPU, 512 GPU)"""
    critic_hidden: int | None = None
    """width of the critics' first layer; later layers halve it (default 256 CPU, 1024 GPU)"""

    # run
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """where the learner runs; auto picks cuda when available. Collectors are always CPU"""
    sync_mode: Literal["lockstep", "pipelined", "async"] = "pipelined"
    """lockstep: collect and learn in turn; pipelined: collect chunk i+1 while learning on
    chunk i (weights one chunk stale, deterministic); async: both free-running"""
    run_dir: str | None = None
    """output folder (default runs/{env}__{script}__{seed}__{timestamp})"""
    save_interval: int = 0
    """env steps between checkpoints; 0 saves only model_final.pt"""
    eval_interval: int = 50_000
    """env steps between deterministic evaluations; 0 evaluates only at the end"""
    eval_episodes: int = 5
    """episodes per evaluation"""
    log_interval: float = 10.0
    """seconds between console progress lines"""
    trace: bool = False
    """write a timeline of the learner and every collector to {run_dir}/trace.json (Chrome
    trace event format: open it in ui.perfetto.dev, or summarize it with
    benchmarks/trace_report.py), at each checkpoint and at the end"""
    trace_events: int = 40_000
    """--trace: records kept per process (about 5 MB of JSON each): the first half of them and
    the newest half"""
    profile_iters: str | None = None
    """A:B: run torch.profiler over the learner's training iterations A to B-1 (counted from
    the first one that updates) and write its trace to {run_dir}/profile.json"""
    resume: str | None = None
    """continue a run: its run dir (newest complete checkpoint) or a checkpoint file; auto:
    --run-dir's newest complete checkpoint if it has one, else a fresh start (safe to re-run
    after any failure). The saved arguments are used, except flags given now"""
    keep_checkpoints: int = 2
    """checkpoint_*.pt files kept (with their replay files); older ones are removed once a
    newer one is complete. model_final.pt is always kept"""
    save_replay: bool = False
    """store the replay buffer with each checkpoint, so that a resumed run continues exactly
    (in lockstep and pipelined modes: the same final parameters as an uninterrupted run)"""
    restart_collector: bool = False
    """if a collector dies, start a fresh one and carry on instead of exiting"""
    eval_only: bool = False
    """only evaluate --checkpoint for --eval-episodes episodes, print mean and std"""
    checkpoint: str | None = None
    """checkpoint file or run dir for --eval-only"""
    capture_video: bool = False
    """record one deterministic episode at each evaluation to {run_dir}/videos (needs
    imageio and offscreen rendering: MUJOCO_GL=egl, the default here, or osmesa)"""
    quiet: bool = False
    """no progress bar or progress lines (evaluations and errors are still printed)"""
    track: bool = False
    """log to Weights & Biases (needs wandb)"""
    wandb_project: str = "fast-rl"
    """wandb project name"""
    # GPU fast path; None means on with a CUDA learner and off on CPU (see README)
    compile: bool | None = None
    """torch.compile the loss computations of the update steps (None: on with CUDA)"""
    cudagraphs: bool = False
    """with --compile on CUDA: capture the compiled losses in CUDA graphs (reduce-overhead)"""
    amp: bool | None = None
    """bf16 autocast in the update steps (None: on with CUDA)"""
    prefetch: bool | None = None
    """gather the next iteration's batch (into pinned memory on CUDA) while this one
    trains; copies to the GPU do not block (None: on with CUDA)"""
    replay_mirror: bool | None = None
    """keep a copy of the replay buffer in the learner's device memory and sample there: per
    iteration only the new rows and the sampled indices cross from the host (None: on with
    CUDA; on CPU it only doubles the buffer's memory)"""
    learner_threads: int | None = None
    """torch threads of the learner on CPU (default: see default_learner_threads)"""


# Support [v_min, v_max] of the C51 critics per env family. It must cover the discounted
# returns the task can produce, about reward_per_step / (1 - gamma): with 1000-step episodes
# and gamma 0.99 a tenth of the episode return. v_max leaves room above the best published
# returns (HalfCheetah 15-17k, Humanoid 10-12k, Ant and Walker2d 6-8k, Hopper 4k) and the
# entropy bonus, so that the projection does not clamp the values of good actions.
VALUE_RANGES = {
    "Pendulum": (-1700.0, 0.0), "HalfCheetah": (-200.0, 2500.0), "Humanoid": (-100.0, 1500.0),
    "HumanoidStandup": (0.0, 20000.0), "Hopper": (-100.0, 600.0), "Walker2d": (-100.0, 1200.0),
    "Ant": (-200.0, 1200.0), "InvertedPendulum": (0.0, 110.0),
    "InvertedDoublePendulum": (0.0, 1000.0),
}

# --target-entropy's default per env family, in nats per action dimension with the actions
# in the [-1, 1] box: a uniform policy has log 2 = 0.69. Measured (README: Entropy target):
# the Humanoids learn sooner with a wide policy, the others with a narrower one.
TARGET_ENTROPY = {"Humanoid": 0.42, "HumanoidStandup": 0.42}
DEFAULT_TARGET_ENTROPY = -0.5

# --n-step's default per env family. Measured (README: Recipe choices): 1 learns sooner on
# HalfCheetah and Humanoid, 3 on Hopper and Walker2d.
N_STEP = {"Hopper": 3, "Walker2d": 3}
DEFAULT_N_STEP = 1

CPU_RECIPE = dict(num_envs=8, buffer_size=1_000_000, batch_size=256, learning_starts=5000,
                  steps_per_iter=8, updates_per_iter=8, actor_hidden=256, critic_hidden=256)
GPU_RECIPE = dict(num_envs=32, buffer_size=1_000_000, batch_size=4096, learning_starts=5000,
                  steps_per_iter=8, updates_per_iter=32, actor_hidden=512, critic_hidden=1024)


# =======================================================================================
# Recipe defaults and argument checks (all before any process starts)


class ArgsError(ValueError):
    """Bad command-line input, reported before any process starts."""


def check_mirror_fits(args: Args, obs_dim: int, act_dim: int) -> None:
    """--replay-mirror on CUDA: the mirror and two samples must fit in this process's GPU
    (torchrun's local rank), next to what the networks need."""
    mirror = Mirror.nbytes(args.num_envs, args.buffer_size // args.num_envs, obs_dim, act_dim)
    sample = batch_nbytes(args.batch_size * args.updates_per_iter, obs_dim, act_dim)
    free = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0]
    if mirror + 2 * sample > free:
        raise ArgsError(f"the replay mirror needs {mirror / 2**30:.1f} GiB of GPU memory and "
                        f"{2 * sample / 2**30:.1f} GiB for samples, but {free / 2**30:.1f} GiB "
                        "are free; lower --buffer-size, or pass --replay-mirror False to "
                        "sample on the host")


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def default_num_collectors(device: str, num_envs: int) -> int:
    """A GPU learner needs about one core to feed the GPU, so the others step envs (one
    collector per 4 envs at most: fewer envs per process batch the actor's inference
    poorly). A CPU learner is the bottleneck of the CPU recipe, so it keeps 3/4 of the
    cores, and on up to 4 cores one collector shares them with it."""
    cores = available_cores()
    if device == "cuda":
        return max(1, min(cores - 2, num_envs // 4))
    return max(1, min(cores // 4, num_envs // 4)) if cores > 4 else 1


def default_learner_threads(num_collectors: int) -> int:
    """The cores the collectors leave free (each collector runs one thread), so that nobody
    shares a core. Measured on 2 cores (README): a second learner thread that shares the
    collector's core gains no updates/s inside a run and slows the collector by about 13%."""
    return max(1, available_cores() - num_collectors)


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


def resolve_args(args: Args, check_shm: bool = True) -> Args:
    """Validate `args`, resolve the env id and fill recipe defaults; raise ArgsError.
    (`check_shm=False`: for callers that never create the replay buffer.)"""
    env_id = resolve_env_id(args.env)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgsError("--device cuda was asked for but torch sees no CUDA device; "
                        "use --device cpu (or auto)")
    device = "cuda" if args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu"
    recipe = GPU_RECIPE if device == "cuda" else CPU_RECIPE
    filled = {k: (v if getattr(args, k) is None else getattr(args, k)) for k, v in recipe.items()}
    family = env_id.split("-v")[0]
    if (args.v_min is None) != (args.v_max is None) and family not in VALUE_RANGES:
        raise ArgsError(f"{env_id} has no value range in VALUE_RANGES: give both --v-min and "
                        "--v-max, or neither (the critics' support then follows the returns "
                        "seen)")
    v_min, v_max = VALUE_RANGES.get(family, (None, None))  # (None: see ReturnRange)
    args = dataclasses.replace(args, env=env_id, device=device, **filled,
                               v_min=v_min if args.v_min is None else args.v_min,
                               v_max=v_max if args.v_max is None else args.v_max)
    if args.target_entropy is None:
        args.target_entropy = TARGET_ENTROPY.get(family, DEFAULT_TARGET_ENTROPY)
    if args.n_step is None:
        args.n_step = N_STEP.get(family, DEFAULT_N_STEP)

    for field in ("total_timesteps", "num_envs", "buffer_size", "batch_size", "steps_per_iter",
                  "updates_per_iter", "actor_hidden", "critic_hidden", "policy_frequency",
                  "n_step", "num_atoms", "eval_episodes", "keep_checkpoints"):
        if getattr(args, field) <= 0:
            raise ArgsError(f"--{field.replace('_', '-')} must be positive, "
                            f"got {getattr(args, field)}")
    for field in ("learning_starts", "save_interval", "eval_interval"):
        if getattr(args, field) < 0:
            raise ArgsError(f"--{field.replace('_', '-')} must be >= 0")
    for flag in ("compile", "amp", "prefetch", "replay_mirror"):
        if getattr(args, flag) is None:
            setattr(args, flag, device == "cuda")
    if args.cudagraphs and not (device == "cuda" and args.compile):
        raise ArgsError("--cudagraphs needs a CUDA learner and --compile")
    if args.num_collectors is None:
        args.num_collectors = default_num_collectors(device, args.num_envs)
    if not 1 <= args.num_collectors <= args.num_envs:
        raise ArgsError(f"--num-collectors must lie in [1, --num-envs ({args.num_envs})], got "
                        f"{args.num_collectors}: each collector steps at least one env")
    if not 0 < args.gamma <= 1 or not 0 < args.tau <= 1:
        raise ArgsError("--gamma and --tau must lie in (0, 1]")
    if args.v_min is not None and args.v_min >= args.v_max:
        raise ArgsError(f"--v-min ({args.v_min}) must be below --v-max ({args.v_max})")
    if args.learning_starts >= args.total_timesteps:
        raise ArgsError(f"--learning-starts ({args.learning_starts}) must be below "
                        f"--total-timesteps ({args.total_timesteps}), or nothing is learned")
    for flag, package in (("track", "wandb"), ("capture_video", "imageio")):
        if getattr(args, flag) and importlib.util.find_spec(package) is None:
            raise ArgsError(f"--{flag.replace('_', '-')} needs the {package} package: "
                            f"pip install {package}")
    if args.profile_iters is not None:
        profile_range(args.profile_iters)
    if args.trace_events < 2:
        raise ArgsError(f"--trace-events must be at least 2, got {args.trace_events}")
    capacity = args.buffer_size // args.num_envs
    chunk = args.steps_per_iter * async_window_chunks(args)
    usable = (capacity - chunk - args.n_step + 1) * args.num_envs
    if capacity < 2 * chunk + args.n_step:
        raise ArgsError(f"--buffer-size {args.buffer_size} gives {capacity} rows per env, too "
                        f"few for --steps-per-iter {args.steps_per_iter}; raise --buffer-size")
    if args.batch_size > usable:
        raise ArgsError(f"--batch-size {args.batch_size} is larger than the {usable} transitions "
                        f"the buffer can offer for sampling; raise --buffer-size (now "
                        f"{args.buffer_size}) or lower --batch-size")
    env = gym.make(env_id)
    space, obs_space = env.action_space, env.observation_space
    env.close()
    if not isinstance(space, gym.spaces.Box):
        raise ArgsError(f"{env_id} has a {type(space).__name__} action space; {SCRIPT} needs "
                        "continuous (Box) actions")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        raise ArgsError(f"{env_id} must have a flat Box observation space, got {obs_space}")
    if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        raise ArgsError(f"{env_id} has unbounded actions; {SCRIPT} squashes into finite bounds")
    nbytes = ReplayBuffer.nbytes(args.num_envs, capacity, obs_space.shape[0], space.shape[0])
    try:  # a default Docker container has only 64 MiB of /dev/shm
        if check_shm:
            check_shm_space(nbytes, "The replay buffer")
        if check_shm and args.replay_mirror and device == "cuda":
            check_mirror_fits(args, obs_space.shape[0], space.shape[0])
    except MemoryError as e:
        raise ArgsError(str(e)) from None
    if args.save_replay:  # the kept files and the one being written; without
        # --save-interval, the one that a signal's checkpoint writes
        files = args.keep_checkpoints + 1 if args.save_interval else 1
        where = Path(args.run_dir or "runs").absolute()
        while not where.exists():
            where = where.parent
        need, free = files * nbytes, shutil.disk_usage(where).free
        why = (f"--keep-checkpoints {args.keep_checkpoints} and the one being written"
               if args.save_interval else "the one a signal's checkpoint writes")
        if need > free:
            raise ArgsError(f"--save-replay needs {need / 2**30:.1f} GiB of disk for {files} "
                            f"replay file(s) of {nbytes / 2**30:.2f} GiB ({why}) but {where} "
                            f"has {free / 2**30:.1f} GiB free; lower --buffer-size or "
                            "--keep-checkpoints, or free disk space")
    return args


# =======================================================================================
# Environments


def make_env(env_id: str, num_envs: int, seed: int = 0):
    """The collectors' vector env: finished envs reset within the same step.

    SAME_STEP autoreset returns the reset observation at once and puts the true last
    observation in info["final_obs"], so every step is a storable transition. (The
    collectors seed env i with seed + i at the first reset.)
    """
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
        return ((x - self.mean) * torch.rsqrt(self.var + 1e-8)).clamp(-self.clip, self.clip)


def mlp(sizes: list[int]) -> nn.Sequential:
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.LayerNorm(b), nn.SiLU()]
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """Tanh-squashed Gaussian policy with bounded log-std and an input normalizer."""

    def __init__(self, obs_dim, act_dim, hidden, low, high, log_std_min, log_std_max):
        super().__init__()
        self.normalizer = Normalizer(obs_dim)
        self.trunk = mlp([obs_dim, hidden, hidden // 2, hidden // 4])
        self.mu = nn.Linear(hidden // 4, act_dim)
        self.log_std = nn.Linear(hidden // 4, act_dim)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        self.register_buffer("scale", torch.as_tensor((high - low) / 2))
        self.register_buffer("bias", torch.as_tensor((high + low) / 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log-std of the pre-tanh Gaussian, from a normalized observation."""
        h = self.trunk(x)
        # float32 from here on: under --amp only the layers run in bf16, while the draw and
        # the log-density (temperature, soft target, logged entropy) need float32
        mu, squashed = self.mu(h).float(), torch.tanh(self.log_std(h).float())
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (squashed + 1)
        return mu, log_std

    def sample(self, x: torch.Tensor, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Action in env units and its log-probability, from a normalized observation."""
        mu, log_std = self(x)
        std = log_std.exp()
        eps = torch.randn(mu.shape, generator=generator, device=mu.device, dtype=torch.float32)
        u = mu + std * eps
        y = torch.tanh(u)
        # Gaussian log-density minus the log-Jacobian of tanh and of the affine rescale
        log_prob = (-0.5 * eps.square() - log_std - 0.5 * math.log(2 * math.pi)
                    - torch.log(self.scale * (1 - y.square()) + 1e-6)).sum(-1)
        return y * self.scale + self.bias, log_prob

    @torch.inference_mode()  # (no autograd bookkeeping at all: measurably cheaper per step)
    def act(self, obs: torch.Tensor, deterministic: bool = False, generator=None):
        """Action for raw observations (normalized here)."""
        x = self.normalizer(obs)
        if deterministic:
            return torch.tanh(self(x)[0]) * self.scale + self.bias
        return self.sample(x, generator)[0]


def make_actor(args: Args, obs_dim: int, act_dim: int, low, high) -> Actor:
    return Actor(obs_dim, act_dim, args.actor_hidden, low, high, args.log_std_min,
                 args.log_std_max)


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
        return self.net(x.unsqueeze(0).expand(self.k, *x.shape))

    def q_values(self, obs, action) -> torch.Tensor:
        """Expected values [2, B] of the critics' distributions."""
        return (self(obs, action).softmax(-1) * self.support).sum(-1)

    @torch.no_grad()
    def set_support(self, v_min: float, v_max: float) -> None:
        """Move the atoms to [v_min, v_max]; the networks stay, so each atom's probability
        now stands for its new value (made on the device: no copy that waits for it)."""
        n, device = self.support.shape[0], self.support.device
        self.support.copy_(torch.linspace(v_min, v_max, n, device=device))


def project(probs, rewards, discounts, support) -> torch.Tensor:
    """C51 projection of the distribution r + discount * Z onto the fixed `support`.

    probs [B, N] on support [N]; rewards, discounts [B]. Mass that lands between two atoms
    is split between them in proportion to the distance.
    """
    n = support.shape[0]
    v_min, v_max = support[0], support[-1]
    delta = (v_max - v_min) / (n - 1)
    tz = (rewards[:, None] + discounts[:, None] * support).clamp(v_min, v_max)
    b = (tz - v_min) / delta
    lo, hi = b.floor().long(), b.ceil().long()
    # when b hits an atom exactly, lo == hi and both weights below would be 0: move one
    lo = torch.where((hi > 0) & (lo == hi), lo - 1, lo)
    hi = torch.where((lo < n - 1) & (lo == hi), hi + 1, hi)
    out = torch.zeros_like(probs)
    out.scatter_add_(1, lo, probs * (hi.to(b.dtype) - b))
    out.scatter_add_(1, hi, probs * (b - lo.to(b.dtype)))
    return out


def initial_support(args: Args) -> tuple[float, float]:
    """[--v-min, --v-max]; without them, a stand-in until ReturnRange sets the support."""
    return (args.v_min, args.v_max) if args.v_min is not None else (-1.0, 1.0)


class ReturnRange:
    """The critics' support on an env that VALUE_RANGES lacks (and without --v-min/--v-max):
    it follows the returns seen. Each env keeps the discounted sum of its episode's rewards
    so far, G <- reward + gamma * G, which spans the range the values span (a constant
    reward r brings both to r / (1 - gamma)). The support covers the lowest and highest G
    seen, and 0, widened by a quarter of that width below and by half of it above, as an
    improving policy's values lie above the returns collected so far. It is set before the
    first update, from the random actions' rewards, and widens as new rows arrive."""

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
        """Restore a checkpoint's range; the sums only when the episodes continue (their
        rows are in the restored replay)."""
        self.lo, self.hi = state["lo"], state["hi"]
        if episodes_continue:
            self.g = state["g"].copy()


def lower_mean_distribution(probs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Per sample, the distribution of the critic whose expected value is lowest.

    probs [K, B, N] -> [B, N]: clipped double Q for distributional critics.
    """
    lower = (probs * support).sum(-1).argmin(0)
    return probs[lower, torch.arange(probs.shape[1], device=probs.device)]


# =======================================================================================
# How a collector acts (an object of this class lives in each collector process: CPU, one
# torch thread). common/collectors.py steps the envs and writes the replay buffer.


class Explorer:
    """The actions of one collector's envs: uniform before --learning-starts, then samples
    of the stochastic policy (the actor's weights are loaded by the harness)."""

    def __init__(self, args: Args, index: int, num_envs: int):
        obs_dim, act_dim, self.low, self.high = env_dims(args.env)
        self.actor = make_actor(args, obs_dim, act_dim, self.low, self.high)
        self.shape = (num_envs, act_dim)
        self.rng = np.random.default_rng(args.seed + 1 + 1000 * index)
        self.gen = torch.Generator().manual_seed(args.seed + 2 + 1000 * index)

    def act(self, obs: np.ndarray, random: bool) -> np.ndarray:
        if random:
            return self.rng.uniform(self.low, self.high, size=self.shape).astype(np.float32)
        return self.actor.act(torch.from_numpy(obs).float(), generator=self.gen).numpy()

    def episodes_ended(self, done: np.ndarray) -> None:
        pass

    def state(self) -> dict:
        """What an exact resume needs besides the envs (saved in collector snapshots)."""
        return {"rng": self.rng.bit_generator.state, "gen": self.gen.get_state()}

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.gen.set_state(state["gen"])


# =======================================================================================
# Learner: losses and the update rule


class Learner:
    """Networks, optimizers and the update rule. The loop that feeds it is `train`."""

    def __init__(self, args: Args, obs_dim, act_dim, low, high, device):
        self.args, self.device = args, device
        self.actor = make_actor(args, obs_dim, act_dim, low, high).to(device)
        self.critics = Critics(obs_dim, act_dim, args.critic_hidden, args.num_atoms,
                               *initial_support(args)).to(device)
        self.critics_target = Critics(obs_dim, act_dim, args.critic_hidden, args.num_atoms,
                                      *initial_support(args)).to(device)
        self.critics_target.load_state_dict(self.critics.state_dict())
        self.critics_target.requires_grad_(False)
        self.log_alpha = torch.tensor(math.log(args.alpha_init), device=device,
                                      requires_grad=True)
        # log_prob is in env units: it includes log|d action / d box| = sum(log(scale))
        self.log_scale = float(np.log((np.asarray(high) - np.asarray(low)) / 2).sum())
        self.target_entropy = act_dim * args.target_entropy + self.log_scale
        self.act_dim = act_dim
        betas = (0.9, 0.95)
        # one fused kernel per optimizer step: one launch on CUDA, and on CPU a third of the
        # time of the multi-tensor (foreach) step (about 140 against 440 us for the critics)
        fused = dict(fused=True)
        self.actor_opt = torch.optim.AdamW(self.actor.parameters(), lr=args.actor_lr,
                                           betas=betas, weight_decay=args.weight_decay,
                                           **fused)
        self.critic_opt = torch.optim.AdamW(self.critics.parameters(), lr=args.critic_lr,
                                            betas=betas, weight_decay=args.weight_decay,
                                            **fused)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=args.alpha_lr, betas=betas,
                                          **fused)
        self.online_params = list(self.critics.parameters())
        self.target_params = list(self.critics_target.parameters())
        self.num_updates = 0
        self.timeline, self.grad_norms = NO_TIMELINE, {}  # (Training sets the timeline)
        self.critic_loss_fn, self.actor_loss_fn = self.critic_loss, self.actor_loss
        if args.compile:
            # (static shapes: every mini-batch has the same size)
            mode = "reduce-overhead" if args.cudagraphs else None
            self.critic_loss_fn = torch.compile(self.critic_loss, mode=mode, dynamic=False)
            self.actor_loss_fn = torch.compile(self.actor_loss, mode=mode, dynamic=False)
        # bf16 autocast; a disabled context costs nothing, so the code path is the same
        self.autocast = lambda: torch.autocast(device.type, torch.bfloat16, enabled=args.amp)

    def critic_loss(self, obs, actions, rewards, next_obs, discounts) -> torch.Tensor:
        with torch.no_grad():
            alpha = self.log_alpha.exp()
            next_actions, next_log_prob = self.actor.sample(next_obs)
            # (under --amp only the layers run in bf16: distributions are float32)
            next_probs = self.critics_target(next_obs, next_actions).float().softmax(-1)
            support = self.critics_target.support  # next_probs: [2, B, N]
            if self.args.use_cdq:
                chosen = lower_mean_distribution(next_probs, support)  # clipped double Q
            else:
                chosen = next_probs.mean(0)
            # the entropy bonus shifts every atom, so it is folded in before projecting
            target = project(chosen, rewards - discounts * alpha * next_log_prob.float(),
                             discounts, support)
        log_probs = self.critics(obs, actions).float().log_softmax(-1)
        return -(target * log_probs).sum(-1).mean(-1).sum()

    def update_critic(self, obs, actions, rewards, next_obs, discounts) -> torch.Tensor:
        with self.autocast():
            loss = self.critic_loss_fn(obs, actions, rewards, next_obs, discounts)
        self.critic_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.grad_norms["critic_grad_norm"] = grad_norm(self.online_params)
        self.critic_opt.step()
        return loss.detach().clone()  # (a CUDA graph's output is overwritten at its replay)

    def actor_loss(self, obs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor's loss plus the temperature's, so that one backward (compiled with the
        rest) serves both: each reaches only its own parameters, as the other's inputs are
        detached. Also the metrics (detached)."""
        actions, log_prob = self.actor.sample(obs)
        q = self.critics.q_values(obs, actions)
        q = (q.min(0).values if self.args.use_cdq else q.mean(0)).float()
        actor_loss = (self.log_alpha.detach().exp() * log_prob - q).mean()
        alpha_loss = -(self.log_alpha.exp() * (log_prob.detach() + self.target_entropy)).mean()
        return actor_loss + alpha_loss, {
            "actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach(),
            "qf_value": q.detach().mean(),  # the actor's Q: how close to --v-max
            # in the units of --target-entropy (per dimension, [-1, 1] box)
            "entropy": -(log_prob.detach().mean() + self.log_scale) / self.act_dim}

    def update_actor(self, obs) -> dict[str, torch.Tensor]:
        self.critics.requires_grad_(False)
        with self.autocast():
            loss, metrics = self.actor_loss_fn(obs)
        self.actor_opt.zero_grad(set_to_none=True)
        self.alpha_opt.zero_grad(set_to_none=True)
        loss.backward()  # (the actor's and the temperature's gradients at once)
        self.grad_norms["actor_grad_norm"] = grad_norm(self.actor.parameters())
        self.actor_opt.step()
        self.alpha_opt.step()
        self.critics.requires_grad_(True)
        return {k: v.clone() for k, v in metrics.items()}  # (see update_critic)

    def train_iteration(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`updates_per_iter` updates on consecutive mini-batches of one large sample.

        Stays on the device: losses are returned as tensors and read by the caller only
        when it logs.
        """
        args = self.args
        norm, mark = self.actor.normalizer, self.timeline.now()
        obs, next_obs = norm(batch["obs"]), norm(batch["next_obs"])
        mark = self.timeline.phase("learner/normalize_batch", mark)
        qf_losses, actor_metrics = [], []
        for start in range(0, obs.shape[0], args.batch_size):
            mb = slice(start, start + args.batch_size)  # (a view: no gather per update)
            qf_losses.append(self.update_critic(obs[mb], batch["actions"][mb],
                                                batch["rewards"][mb], next_obs[mb],
                                                batch["discounts"][mb]))
            mark = self.timeline.phase("learner/update_critic", mark)
            self.num_updates += 1
            if self.num_updates % args.policy_frequency == 0:
                actor_metrics.append(self.update_actor(obs[mb]))
                mark = self.timeline.phase("learner/update_actor", mark)
            with torch.no_grad():  # else every lerp joins an ever-growing autograd graph
                torch._foreach_lerp_(self.target_params, self.online_params, args.tau)
            mark = self.timeline.phase("learner/target_update", mark)
        out = {"qf_loss": torch.stack(qf_losses).mean(), "alpha": self.log_alpha.detach().exp()}
        for key in actor_metrics[0] if actor_metrics else ():
            out[key] = torch.stack([m[key] for m in actor_metrics]).mean()
        out |= self.grad_norms  # (the last update's)
        return out

    @torch.no_grad()
    def diagnostics(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Read when logging is due (not per update), at the newest sample's raw `obs`: the
        policy's standard deviation (of the Gaussian before tanh; mean over the batch and
        the action dimensions) and the lowest and highest Q of both critics at its actions."""
        x = self.actor.normalizer(obs)
        q = self.critics.q_values(x, self.actor.sample(x)[0]).float()
        return {"action_std": self.actor(x)[1].float().exp().mean(), "qf_min": q.min(),
                "qf_max": q.max()}

    def all_finite(self) -> bool:
        tensors = [*self.actor.parameters(), *self.critics.parameters(), self.log_alpha]
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    SAVED = ("actor", "critics", "critics_target", "actor_opt", "critic_opt", "alpha_opt")

    def state_dict(self) -> dict:
        return {k: getattr(self, k).state_dict() for k in self.SAVED} | {
            "log_alpha": self.log_alpha.detach().cpu(), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        for k in self.SAVED:
            saved, mine = state[k], getattr(self, k).state_dict()
            if "param_groups" in saved:  # an optimizer: its moments, but this run's
                # settings (learning rate, weight decay and betas, from the saved arguments
                # or the flags given on resume) and this machine's kernel choice
                groups = [g | {f: v for f, v in m.items() if f != "params"}
                          for g, m in zip(saved["param_groups"], mine["param_groups"])]
                saved = saved | {"param_groups": groups}
            getattr(self, k).load_state_dict(saved)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.num_updates = state["num_updates"]


def warm_up(learner, obs_dim: int, act_dim: int) -> None:
    """--compile: compile both update steps now by running them once on made-up data, so
    that a compile error stops the run in its first seconds, before any process starts.
    The networks, optimizers, counters and random state are put back afterwards."""
    saved = copy.deepcopy(learner.state_dict())
    cuda = learner.device.type == "cuda"
    rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None
    rows = learner.args.batch_size * learner.args.policy_frequency  # (the actor's turn too)
    batch = {k: torch.zeros(shape, device=learner.device)
             for k, shape in batch_shapes(rows, obs_dim, act_dim).items()}
    try:
        learner.train_iteration(batch)
        if cuda:
            torch.cuda.synchronize(learner.device)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        raise ArgsError(f"--compile failed in the warm-up update ({type(e).__name__}: "
                        f"{first_line}); run with --compile False") from e
    learner.load_state_dict(saved)
    torch.set_rng_state(rng[0])
    if cuda:
        torch.cuda.set_rng_state_all(rng[1])


# =======================================================================================
# The training loop. Plumbing from here on: a new idea rarely needs a change below.


def train(args: Args, resume: dict | None = None) -> int:
    """Run one training job (continuing `resume`, a loaded checkpoint); returns the exit code.

    Each iteration: wait until the chunk the schedule names is collected, fold its
    observations into the normalizer, train on a sample, publish the actor's weights, log,
    and evaluate or save when due. See DESIGN.md for the schedule.
    """
    stop = StopRequest()
    try:
        run = Training(args)
    except ArgsError as e:  # (--compile: its warm-up failed)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    status, exit_code = "failed", 1
    try:
        run.start(resume)
        done = False
        while not done:
            with run.timeline.span("learner/wait_for_data"):
                chunks, window = run.collectors.wait_for_chunk(run.loop["iteration"], run.written)
            done = run.advance(chunks)
            stopping = stop.signum is not None and not done  # (a signal arrived)
            save_now = run.plan_checkpoint(chunks, done, stopping)
            run.learn(chunks, window, done)
            run.publish_weights()
            run.log(done)
            if run.loop["global_step"] >= run.next_eval and not (done or stopping):
                run.evaluate()
            if save_now:
                name = run.save_with_snapshot()
            if stopping:
                raise Interrupted(f"{name} written {time.perf_counter() - stop.t:.1f} s after "
                                  f"signal {stop.signum}")
        run.finish()
        status, exit_code = "completed", 0
    except Interrupted as e:
        status, exit_code = "interrupted", 130
        run.progress.close()
        print(f"interrupted: {e}; stopping", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # a second signal: stop now, the newest checkpoint stays
        status, exit_code = "interrupted", 130
        run.progress.close()
        print("interrupted again: stopping without a checkpoint", file=sys.stderr, flush=True)
    except CollectorError as e:
        run.progress.close()
        print(f"error: {e}", file=sys.stderr, flush=True)
    except Diverged as e:
        status = "diverged"
        run.progress.close()
        print(f"error: {e}", file=sys.stderr, flush=True)
    finally:
        run.close()
    run.write_summary(status)
    return exit_code


class Training:
    """One run's parts (buffers, collectors, learner, outputs) and counters; `train` calls
    these methods in the order of an iteration."""

    def __init__(self, args: Args):
        self.args, self.t_start = args, time.time()
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            K = args.num_collectors
            torch.set_num_threads(args.learner_threads or default_learner_threads(K))
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # fp32 matmuls on tensor cores too
        torch.manual_seed(args.seed)
        self.rng = np.random.default_rng(args.seed)
        self.dims = env_dims(args.env)
        self.learner = Learner(args, *self.dims, self.device)
        if args.compile:
            warm_up(self.learner, *self.dims[:2])
        self.run_dir = args.run_dir or (f"runs/{args.env}__{SCRIPT}__{args.seed}__"
                                        f"{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(self.run_dir, exist_ok=True)
        self.writer = make_writer(args, self.run_dir)
        self.collectors = None
        # what a checkpoint must carry besides the networks to continue the loop exactly;
        # floor: env-local steps below it hold no data (after a resume without the replay)
        self.loop = dict(iteration=0, version=0, normalized_upto=0, floor=0, global_step=0)
        self.timers = dict(learn=0.0, sample=0.0, sync=0.0)
        self.t_first_update = self.t_last_update = self.metrics = self.prefetched = None
        self.final_eval, self.ctrl_timing = None, np.zeros(4)
        self.progress = Progress(args, self.learner)
        # --trace: this process's timeline and its collectors' (off: NO_TIMELINE, nothing)
        self.trace = Trace(args.trace_events, cuda=self.device.type == "cuda") if args.trace \
            else None
        self.timeline = self.learner.timeline = self.trace.learner if self.trace else NO_TIMELINE
        self.profiler = IterationProfiler(args.profile_iters, self.run_dir)
        # episode ends by cause and the policy lag (summed over iterations), whole run and
        # at the last progress line
        self.tally = dict(terminated=0, truncated=0, lag=0.0, lag_iterations=0)
        self.tally_logged = dict(self.tally)
        self.last_obs = None
        # the critics' support follows the returns seen (an env VALUE_RANGES lacks)
        self.value_range = ReturnRange(args.num_envs, args.gamma) if args.v_min is None else None

    def start(self, resume: dict | None) -> None:
        """Create the shared memory, load `resume`, publish the first weights and start the
        collectors."""
        args, (obs_dim, act_dim, low, high) = self.args, self.dims
        self.collectors = Collectors.create(SCRIPT, args, self.run_dir,
                                            make_actor(args, obs_dim, act_dim, low, high),
                                            obs_dim, act_dim)
        self.rb, self.ws, self.ctrl = self.collectors.rb, self.collectors.ws, self.collectors.ctrl
        starts = [None] * args.num_collectors
        if resume is not None:
            starts = restore(resume, self)
        self.ws.publish(self.learner.actor, self.loop["version"])
        self.collectors.start(make_env, Explorer, starts)
        self.episodes_seen = [0] * args.num_collectors
        rows = args.batch_size * args.updates_per_iter
        if args.replay_mirror:
            self.sample = Mirror(self.rb, self.rng, self.device, rows, args.n_step, args.gamma)
        else:
            self.sample = Sampler(self.rb, self.rng, self.device, rows, args.n_step,
                                  args.gamma, pinned=args.prefetch)
        self.next_save = next_multiple(self.loop["global_step"], args.save_interval)
        self.next_eval = next_multiple(self.loop["global_step"], args.eval_interval)
        self.written = self.loop["normalized_upto"]

    def advance(self, chunks: int) -> bool:
        """Count the env steps collected and how many weight versions behind the learner the
        newest chunk was collected with; True when this is the last iteration."""
        versions = self.ctrl.chunk_versions(chunks - 1)
        if (versions >= 0).all():
            self.tally["lag"] += self.loop["version"] - float(versions.mean())
            self.tally["lag_iterations"] += 1
        self.written = chunks * self.args.steps_per_iter
        self.loop["global_step"] = self.written * self.args.num_envs
        return chunks >= self.collectors.num_chunks

    def plan_checkpoint(self, chunks: int, done: bool, stopping: bool) -> bool:
        """Whether this iteration ends with a checkpoint; if so, ask the collectors for a
        snapshot now. It holds their state at the start of the chunk that needs this
        iteration's weights, so it is asked for before they are published (async
        collectors drift apart, so with several there is no common snapshot)."""
        self.snapshot_chunk = self.collectors.snapshot_chunk(chunks)
        save_now = (self.loop["global_step"] >= self.next_save or stopping) and not done
        if save_now and self.snapshot_chunk is not None:
            self.collectors.ask_snapshot(self.snapshot_chunk)
        return save_now

    def learn(self, chunks: int, window: int, done: bool) -> None:
        """Fold the new observations into the normalizer, then train on a sample."""
        args, loop, learner = self.args, self.loop, self.learner
        written, t0 = self.written, time.perf_counter()
        mark = self.timeline.now()
        if written > loop["normalized_upto"]:
            first = max(loop["normalized_upto"], written - self.rb.capacity, loop["floor"])
            # (a pageable copy, but the GPU is idle here: the last iteration ended reading
            # its losses and weights back, so it waits for nothing)
            new_obs = torch.from_numpy(self.rb.rows(first, written)).to(self.device)
            learner.actor.normalizer.update(new_obs)
            if self.value_range is not None:
                self.follow_returns(first, written)
            loop["normalized_upto"] = written
            mark = self.timeline.phase("learner/normalizer_update", mark)
        if (loop["global_step"] >= args.learning_starts
                and (written - loop["floor"]) * args.num_envs >= args.learning_starts):
            self.profiler.step()
            batch = self.prefetched or self.draw(written, window, loop["floor"])
            self.last_obs = batch["obs"][:args.batch_size]  # (for diagnostics when logging)
            mark = self.timeline.phase("learner/replay_sample", mark, {"chunks": chunks})
            self.metrics = learner.train_iteration(batch)  # on a GPU this returns at once
            mark = self.timeline.now()
            self.prefetched = None
            if args.prefetch and args.sync_mode != "lockstep" and not done:
                self.prefetch(chunks, window)
                mark = self.timeline.phase("learner/prefetch", mark)
            check_finite(self.metrics, loop["global_step"], learner.num_updates)
            self.timeline.phase("learner/check_finite", mark)  # (on a GPU: waits for it)
            self.t_first_update = self.t_first_update or t0
            self.t_last_update = time.perf_counter()
        self.timers["learn"] += time.perf_counter() - t0

    def follow_returns(self, first: int, written: int) -> None:
        """Widen the critics' support to the returns in the new rows (see ReturnRange)."""
        vr, idx = self.value_range, np.arange(first, written) % self.rb.capacity
        vr.update(self.rb.rewards[:, idx], self.rb.dones[:, idx])
        if (support := vr.changed_support()) is not None:
            for critics in (self.learner.critics, self.learner.critics_target):
                critics.set_support(*support)

    def prefetch(self, chunks: int, window: int) -> None:
        """--prefetch: gather the next sample while the GPU trains, with the same rows and
        random draws as gathering it at the next iteration (lockstep has no next chunk
        before the weights are published)."""
        ctrl, S = self.ctrl, self.args.steps_per_iter
        nxt, nxt_window = ctrl.slowest(), window  # async: whatever is complete
        if self.args.sync_mode == "pipelined":
            nxt, nxt_window = chunks + 1, S if chunks + 1 < self.collectors.num_chunks else 0
            with contextlib.suppress(CollectorError):  # (handled in wait_for_chunk)
                self.collectors.wait_until(lambda: ctrl.slowest() >= nxt)
        if ctrl.slowest() >= nxt:
            if self.args.sync_mode == "async":
                self.collectors.reading(nxt)
            self.prefetched = self.draw(nxt * S, nxt_window, self.loop["floor"])

    def draw(self, written: int, window: int, floor: int) -> dict[str, torch.Tensor]:
        """A sample of the rows before `written` (see Sampler); its time counts as the
        learner's wait for the sample."""
        t0, mark = time.perf_counter(), self.timeline.now()
        if isinstance(self.sample, Mirror):  # (its copy of the new rows, then the gather)
            self.sample.update(written, window, floor)
            mark = self.timeline.phase("learner/mirror_copy", mark)
        batch = self.sample(written, window, floor)
        self.timeline.phase("learner/gather", mark)
        self.timers["sample"] += time.perf_counter() - t0
        return batch

    def publish_weights(self) -> None:
        t0, mark = time.perf_counter(), self.timeline.now()
        self.loop["version"] += 1
        self.ws.publish(self.learner.actor, self.loop["version"])
        self.timers["sync"] += time.perf_counter() - t0
        self.loop["iteration"] += 1
        self.timeline.phase("learner/weight_sync_write", mark)
        self.timeline.counter("weights_version", self.loop["version"])

    def log(self, done: bool) -> None:
        """Episodes as they finish, losses every 10 iterations, rates when progress is due."""
        writer, step, learner = self.writer, self.loop["global_step"], self.learner
        mark = self.timeline.now()
        self.episodes_seen, episodes = self.ctrl.all_episodes_since(self.episodes_seen)
        for ret, length, at, terminated, *term_sums in episodes:
            writer.add_scalar("charts/episodic_return", ret, int(at))
            writer.add_scalar("charts/episodic_length", length, int(at))
            for name, value in zip(self.collectors.reward_terms, term_sums):
                writer.add_scalar(f"charts/episodic_{name}", value, int(at))
            self.tally["terminated" if terminated else "truncated"] += 1
            self.progress.episode(ret)
        if self.metrics is not None and (self.loop["iteration"] % 10 == 0 or done):
            metrics = self.metrics | learner.diagnostics(self.last_obs)
            for k, v in zip(metrics, torch.stack(list(metrics.values())).tolist()):
                writer.add_scalar(f"losses/{k}", v, step)
            if self.trace:  # (one device sync, only now)
                self.trace.resolve_device()
        if self.trace:
            self.trace.drain(self.ctrl, [proc.pid for proc in self.collectors.procs])
            self.timeline.counter("replay_rows", self.loop["global_step"])
        if self.progress.due() or done:
            elapsed = time.time() - self.t_start
            writer.add_scalar("charts/SPS", int(step / elapsed), step)
            writer.add_scalar("charts/update_to_data", learner.num_updates / max(step, 1), step)
            self.log_window(step)
            writer.add_scalar("perf/updates_per_sec", self.progress.updates_per_s(), step)
            timing = self.ctrl.mean_timing()
            writer.add_scalar("perf/collect_time", timing[COLLECT_S], step)
            writer.add_scalar("perf/collector_weight_wait", timing[WEIGHT_WAIT_S], step)
            writer.add_scalar("perf/collector_weight_load", timing[WEIGHT_LOAD_S], step)
            for k, v in self.all_timers().items():
                writer.add_scalar(f"perf/{k}_time", v, step)
            self.progress.show(step, elapsed)
        self.timeline.phase("learner/log", mark)

    def log_window(self, step: int) -> None:
        """Rates since the last progress line: how episodes ended, the policy lag; and the
        replay ratio (transitions sampled per transition collected)."""
        now, last, writer = self.tally, self.tally_logged, self.writer
        terminated, truncated = (now[k] - last[k] for k in ("terminated", "truncated"))
        if terminated + truncated:
            writer.add_scalar("charts/terminated_rate", terminated / (terminated + truncated),
                              step)
            writer.add_scalar("charts/truncated_rate", truncated / (terminated + truncated),
                              step)
        if now["lag_iterations"] > last["lag_iterations"]:
            writer.add_scalar("charts/policy_lag", (now["lag"] - last["lag"])
                              / (now["lag_iterations"] - last["lag_iterations"]), step)
        writer.add_scalar("charts/replay_ratio", self.replay_ratio(), step)
        if self.value_range is not None:
            for name, value in zip(("v_min", "v_max"), self.value_range.support()):
                writer.add_scalar(f"charts/{name}", value, step)
        self.tally_logged = dict(now)

    def evaluate(self, final: bool = False) -> None:
        """Deterministic episodes on a separate env (and a video with --capture-video)."""
        args, step, mark = self.args, self.loop["global_step"], self.timeline.now()
        returns = evaluate(self.learner.actor, args.env, args.eval_episodes, args.seed,
                           self.device)
        self.writer.add_scalar("eval/episodic_return", returns.mean(), step)
        if args.capture_video:
            record_video(self.learner.actor, args, self.device, self.run_dir, step)
        if final:
            self.final_eval = float(returns.mean())
            print(f"final eval: return {self.final_eval:.1f} +- {returns.std():.1f}", flush=True)
        else:
            self.progress.say(f"eval at step {step:,}: return {returns.mean():.1f} "
                              f"+- {returns.std():.1f}")
            self.next_eval = next_multiple(step, args.eval_interval)
        self.timeline.phase("learner/evaluate", mark)

    def save_with_snapshot(self) -> str:
        """A checkpoint, with the collectors' snapshot when one was asked for; its name."""
        name, collector_state = f"checkpoint_{self.loop['global_step']}.pt", None
        mark = self.timeline.now()
        if self.snapshot_chunk is not None:
            collector_state = self.collectors.snapshots()
        self.checkpoint(name, collector_state)
        self.next_save = next_multiple(self.loop["global_step"], self.args.save_interval)
        self.timeline.phase("learner/checkpoint", mark)
        self.write_trace()  # (an interrupted run keeps the timeline up to here)
        return name

    def checkpoint(self, name: str, collector_state: list[dict] | None) -> None:
        """Save networks, optimizers, counters and RNG; with the collectors' snapshot (and
        the replay, with --save-replay) a resumed run continues exactly."""
        if not self.learner.all_finite():
            raise Diverged(f"non-finite parameters at env step {self.loop['global_step']}; "
                           "the last good checkpoint is kept")
        state = self.learner.state_dict() | {
            "args": dataclasses.asdict(self.args), "script": SCRIPT, **self.loop,
            "restarts": self.collectors.restarts,
            "rng": self.rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "collector": collector_state, "replay": None,
            "value_range": self.value_range and self.value_range.state()}
        if collector_state is not None and self.args.save_replay:
            state["replay"] = name.removesuffix(".pt") + ".replay.npz"
            self.rb.save(os.path.join(self.run_dir, state["replay"]),
                         collector_state[0]["chunk"] * self.args.steps_per_iter)
        path = os.path.join(self.run_dir, name)  # (via a rename: never half-written)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        for step in checkpoint_steps(self.run_dir)[:-self.args.keep_checkpoints]:
            for old in (f"checkpoint_{step}.pt", f"checkpoint_{step}.replay.npz"):
                with contextlib.suppress(FileNotFoundError):  # (the .pt first: a crash
                    os.remove(os.path.join(self.run_dir, old))  # never leaves it orphaned)

    def finish(self) -> None:
        """After the last iteration: the final evaluation and model_final.pt."""
        self.collectors.check()
        self.progress.close()
        self.evaluate(final=True)
        self.checkpoint("model_final.pt", None)

    def write_trace(self) -> None:
        """--trace: the timeline so far, to {run_dir}/trace.json."""
        if self.trace is not None and self.collectors is not None:
            self.trace.drain(self.ctrl, [proc.pid for proc in self.collectors.procs])
            self.trace.write(os.path.join(self.run_dir, "trace.json"),
                             {"script": SCRIPT, "sync_mode": self.args.sync_mode})

    def replay_ratio(self) -> float:
        """Transitions sampled per transition collected."""
        sampled = self.learner.num_updates * self.args.batch_size
        return sampled / max(self.loop["global_step"], 1)

    def close(self) -> None:
        """Stop the collectors first, then remove the shared memory."""
        try:  # (a profile or trace that cannot be written must not keep the collectors running)
            self.profiler.stop()
            self.write_trace()
        except Exception as e:
            print(f"warning: --trace/--profile-iters: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        if self.collectors is not None:
            self.ctrl_timing = self.ctrl.mean_timing()
            self.collectors.close()
        for tmp in glob.glob(os.path.join(self.run_dir, "*.tmp")):  # cut off by a 2nd signal
            os.remove(tmp)
        self.writer.close()

    def write_summary(self, status: str) -> None:
        loop, learner = self.loop, self.learner
        summary = {
            "status": status, "env_id": self.args.env, "sync_mode": self.args.sync_mode,
            "total_env_steps": loop["global_step"], "num_updates": learner.num_updates,
            "iterations": loop["iteration"], "wall_time_s": round(time.time() - self.t_start, 2),
            "final_eval_return": self.final_eval, "device": self.args.device,
            "seed": self.args.seed, "perf": self.perf(),
            "collector_restarts": self.collectors.restarts if self.collectors else 0,
            "episodes_terminated": self.tally["terminated"],
            "episodes_truncated": self.tally["truncated"],
            "replay_ratio": round(self.replay_ratio(), 3),
            "policy_lag": (round(self.tally["lag"] / self.tally["lag_iterations"], 3)
                           if self.tally["lag_iterations"] else None),
        }
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)

    def all_timers(self) -> dict:
        """Seconds spent waiting for collectors, learning and publishing weights."""
        return {"wait": self.collectors.wait_s if self.collectors else 0.0, **self.timers}

    def perf(self) -> dict:
        """Throughput figures for summary.json (rates over the time each part was busy)."""
        collect_s, timers = float(self.ctrl_timing[COLLECT_S]), self.all_timers()
        steps, updates = self.loop["global_step"], self.learner.num_updates
        training_s = (self.t_last_update - self.t_first_update) if self.t_first_update else 0

        def rate(n, seconds):
            return round(n / seconds, 1) if seconds else None

        return {"collect_s": round(collect_s, 3),
                "collector_weight_wait_s": round(self.ctrl_timing[WEIGHT_WAIT_S], 3),
                **{f"{k}_s": round(v, 3) for k, v in timers.items()},
                "collector_steps_per_s": rate(steps, collect_s),
                "learner_updates_per_s": rate(updates, timers["learn"]),
                "updates_per_s_since_first_update": rate(updates, training_s)}


class Diverged(RuntimeError):
    pass


class StopRequest:
    """SIGINT and SIGTERM: the first asks for a stop after a complete checkpoint at the next
    iteration (see `train`); a second one aborts at once (KeyboardInterrupt), except a
    SIGTERM after a SIGTERM: on a cluster the same notice comes from the scheduler and again
    from a launcher that forwards it (torchrun), and the checkpoint it asks for is already
    under way."""

    def __init__(self):
        self.signum, self.t = None, 0.0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        if self.signum is None:
            self.signum, self.t = signum, time.perf_counter()
        elif not signum == self.signum == signal.SIGTERM:
            raise KeyboardInterrupt(f"second signal {signum}")


class Interrupted(Exception):
    """Stopped by a signal after the checkpoint it asked for."""


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


def profile_range(text: str) -> tuple[int, int]:
    """--profile-iters A:B -> (A, B)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise ArgsError(f"--profile-iters must be A:B with A < B (training iterations A to "
                        f"B-1, counted from the first update), got '{text}'")
    return int(m.group(1)), int(m.group(2))


class IterationProfiler:
    """--profile-iters A:B: torch.profiler (CPU, and CUDA kernels on a GPU) over training
    iterations A to B-1, written to {run_dir}/profile.json (Chrome trace format, like
    trace.json): where a launch-bound learner spends its time, kernel by kernel."""

    def __init__(self, iters: str | None, run_dir: str):
        self.range, self.run_dir = profile_range(iters) if iters else None, run_dir
        self.count, self.prof = 0, None

    def step(self) -> None:
        """Call at the start of every training iteration."""
        if self.range is None:
            return
        if self.count == self.range[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
        elif self.count == self.range[1]:
            self.stop()
        self.count += 1

    def stop(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(os.path.join(self.run_dir, "profile.json"))


# =======================================================================================
# Logging and evaluation


def make_writer(args: Args, run_dir: str):
    """TensorBoard (and wandb with --track), with the arguments as a text table."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(run_dir)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project, config=vars(args), sync_tensorboard=True,
                   name=os.path.basename(run_dir), dir=run_dir)
    return writer


class Progress:
    """A tqdm bar on a terminal, a line every --log-interval seconds otherwise; --quiet
    prints only evaluations and errors."""

    def __init__(self, args: Args, learner: Learner):
        from tqdm import tqdm

        self.args, self.learner, self.recent = args, learner, []
        self.bar = None
        if not args.quiet and sys.stdout.isatty():
            self.bar = tqdm(total=args.total_timesteps, unit="step", dynamic_ncols=True)
        self.t_last, self.updates_last, self.step_last = time.perf_counter(), 0, 0
        self.interval = 0.5 if self.bar is not None else args.log_interval

    def episode(self, ret: float) -> None:
        self.recent = (self.recent + [ret])[-20:]

    def due(self) -> bool:
        return time.perf_counter() - self.t_last >= self.interval

    def updates_per_s(self) -> float:
        return (self.learner.num_updates - self.updates_last) / (time.perf_counter() - self.t_last)

    def show(self, global_step: int, elapsed: float) -> None:
        now = time.perf_counter()
        sps = (global_step - self.step_last) / (now - self.t_last)
        ups, updates = self.updates_per_s(), self.learner.num_updates
        ret = f"{np.mean(self.recent):9.1f}" if self.recent else "      n/a"
        if self.bar is not None:
            self.bar.update(global_step - self.bar.n)
            self.bar.set_postfix_str(f"SPS {sps:.0f} | updates/s {ups:.1f} | return {ret.strip()}")
        elif not self.args.quiet:
            print(f"step {global_step:>9,} | {elapsed:7.1f}s | SPS {sps:7.0f} | updates/s "
                  f"{ups:6.1f} | updates {updates:>8,} | return {ret}", flush=True)
        self.t_last, self.updates_last, self.step_last = now, updates, global_step

    def say(self, text: str) -> None:
        (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


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
# Checkpoints and resume


def checkpoint_steps(run_dir: str) -> list[int]:
    """The env steps of the checkpoint_*.pt files in `run_dir`, oldest first."""
    names = (re.fullmatch(r"checkpoint_(\d+)\.pt", f) for f in os.listdir(run_dir))
    return sorted(int(m.group(1)) for m in names if m)


def find_checkpoint(path: str) -> tuple[str, dict, Args]:
    """The checkpoint `path`, or the newest complete one in the run dir `path` (it loads,
    and its replay file, when it names one, is whole; others are skipped with a warning),
    with its arguments. Newest means written last (model_final.pt too)."""
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise ArgsError(f"checkpoint {path} does not exist")
        return path, *load_checkpoint(path)
    names = [f"checkpoint_{s}.pt" for s in checkpoint_steps(path)] + ["model_final.pt"]
    files = [os.path.join(path, n) for n in names if os.path.exists(os.path.join(path, n))]
    for file in sorted(files, key=os.path.getmtime, reverse=True):
        try:
            return file, *load_checkpoint(file)
        except ArgsError as e:
            print(f"warning: skipping {file}: {e}", file=sys.stderr, flush=True)
    raise ArgsError(f"no complete checkpoint_*.pt or model_final.pt in {path}")


def load_checkpoint(path: str) -> tuple[dict, Args]:
    """A checkpoint written by this script, and its arguments."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ArgsError(f"cannot read checkpoint {path}: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("script") != SCRIPT:
        raise ArgsError(f"{path} was not written by {SCRIPT}.py "
                        f"(script: {ckpt.get('script') if isinstance(ckpt, dict) else '?'})")
    replay = ckpt["replay"] and os.path.join(os.path.dirname(path), ckpt["replay"])
    if replay and not ReplayBuffer.file_is_whole(replay):
        raise ArgsError(f"its replay file {replay} is missing or cut off")
    known = {f.name for f in dataclasses.fields(Args)}  # (flags removed since are dropped)
    return ckpt, Args(**{k: v for k, v in ckpt["args"].items() if k in known})


# fields that must match between a checkpoint and the run that continues it
RESUME_FIXED = ("env", "num_envs", "num_collectors", "buffer_size", "steps_per_iter",
                "actor_hidden", "critic_hidden", "num_atoms", "n_step", "sync_mode", "v_min",
                "v_max")


def flags_given(argv: list[str]) -> set[str]:
    """The Args fields named on the command line (`--total-timesteps 5`, `--x=5`, `--quiet`,
    `--no-quiet`), whatever their values: on resume they override the saved arguments, even
    where they equal the defaults."""
    names, given = {f.name for f in dataclasses.fields(Args)}, set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            given.add(name if name in names else name.removeprefix("no_"))
    return given & names


def load_for_resume(args: Args, given: set[str]) -> tuple[Args, dict]:
    """The checkpoint named by --resume and the arguments to continue it with: the saved
    ones, overridden by the flags given on this command line (`given`, see flags_given),
    whatever their values. No checkpoint (None) with --resume auto and a --run-dir that has
    no complete one."""
    auto = args.resume == "auto"
    if auto and not args.run_dir:
        raise ArgsError("--resume auto needs --run-dir: the run to continue or to start")
    if auto and not os.path.isdir(args.run_dir):
        return dataclasses.replace(args, resume=None), None
    try:
        path, ckpt, saved_args = find_checkpoint(args.run_dir if auto else args.resume)
    except ArgsError as e:
        if not auto:
            raise
        print(f"--resume auto: starting fresh ({e})", file=sys.stderr, flush=True)
        return dataclasses.replace(args, resume=None), None
    saved, defaults = vars(saved_args), vars(Args())
    given = {k: v for k, v in vars(args).items() if k in given}
    for key in ("device", "compile", "amp", "prefetch", "replay_mirror", "cudagraphs",
                "learner_threads"):
        saved[key] = defaults[key]  # resolved again for this machine (shapes stay saved)
    for key in RESUME_FIXED:
        if key in given and key != "env" and given[key] != saved[key]:
            raise ArgsError(f"--{key.replace('_', '-')} {given[key]} does not match the "
                            f"checkpoint's {saved[key]}; a run continues with its own shapes")
    if "env" in given and resolve_env_id(given["env"]) != saved["env"]:
        raise ArgsError(f"{path} was trained on {saved['env']}, not {given['env']}")
    merged = Args(**(saved | given | {"resume": args.resume}))
    merged.run_dir = merged.run_dir or os.path.dirname(path)
    ckpt["dir"], ckpt["path"] = os.path.dirname(path), path
    return merged, ckpt


def restore(ckpt: dict, run: Training) -> list[dict]:
    """Load a checkpoint into the learner and the buffers; returns the collectors' starts."""
    run.learner.load_state_dict(ckpt)
    run.rng.bit_generator.state = ckpt["rng"]
    torch.set_rng_state(ckpt["torch_rng"])
    if ckpt.get("cuda_rng") and run.device.type == "cuda":
        with contextlib.suppress(RuntimeError):  # (another number of GPUs: fresh noise)
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
    loop, S = run.loop, run.args.steps_per_iter
    loop.update({k: ckpt[k] for k in loop if k in ckpt})
    run.collectors.restarts = ckpt["restarts"]
    if run.value_range is not None and ckpt.get("value_range"):
        run.value_range.load(ckpt["value_range"], episodes_continue=bool(ckpt["replay"]))
    # without a snapshot, fresh episodes start at the chunk that uses the saved weights
    first = loop["version"] + (1 if ckpt["args"]["sync_mode"] == "pipelined" else 0)
    starts = ckpt["collector"] or [{"chunk": first, "restart": ckpt["restarts"] + 1}] * run.ctrl.num
    chunk = starts[0]["chunk"]
    print(f"resuming {ckpt['path']} at env step {loop['global_step']:,}", flush=True)
    if not ckpt["replay"]:  # nothing below this chunk is in the buffer: refill first
        loop["floor"] = chunk * S
        loop["normalized_upto"] = max(loop["normalized_upto"], chunk * S)
    run.collectors.resume_at(chunk, ckpt["replay"] and os.path.join(ckpt["dir"], ckpt["replay"]))
    return starts


def evaluate_checkpoint(args: Args) -> int:
    """--eval-only: mean and std of the return of a saved policy."""
    path, ckpt, saved = find_checkpoint(args.checkpoint)
    obs_dim, act_dim, low, high = env_dims(saved.env)
    actor = make_actor(saved, obs_dim, act_dim, low, high)
    actor.load_state_dict(ckpt["actor"])
    returns = evaluate(actor, saved.env, args.eval_episodes, args.seed, "cpu")
    print(f"{saved.env}: return {returns.mean():.1f} +- {returns.std():.1f} over "
          f"{args.eval_episodes} deterministic episodes ({path})")
    return 0


def main(argv=None) -> int:
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv)
    if args.capture_video:  # offscreen MuJoCo rendering without a display
        os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        if args.eval_only:
            if not args.checkpoint:
                raise ArgsError("--eval-only needs --checkpoint PATH (a .pt file or run dir)")
            return evaluate_checkpoint(args)
        resume = None
        if args.resume:
            args, resume = load_for_resume(args, flags_given(argv))
        if resume is not None and resume["global_step"] >= args.total_timesteps:
            print(f"the checkpoint has {resume['global_step']:,} env steps already "
                  f"(--total-timesteps {args.total_timesteps:,}): nothing to do")
            return 0
        args = resolve_args(args)
    except ArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return train(args, resume)


if __name__ == "__main__":
    sys.exit(main())
