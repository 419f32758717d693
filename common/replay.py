"""ReplayBuffer: one ring per environment in shared memory, with n-step sampling.

Layout: every field has shape [num_envs, capacity_per_env, ...], so an env's transitions are
contiguous in time. A row holds (obs, action, reward, next_obs, terminated, done), where
`done` marks the last step of an episode (terminated or truncated) and `next_obs` is the
true next observation (the final one at an episode end, never the reset one).

Writers fill rows first and publish them afterwards by raising the per-env `written`
counter; readers only sample rows below a counter they were given, so a row that is being
written is never read.

Ownership: the learner creates the segment (`create`) and unlinks it after its collectors
are gone; collectors `attach` and write only the rows of their own envs. `Sampler` runs in
the learner and moves sampled batches to the learner's device.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
import torch

from common.shm import SharedArrays, nbytes_of

FIELDS = ("obs", "next_obs", "actions", "rewards", "terminated", "dones")


def _specs(num_envs: int, capacity: int, obs_dim: int, act_dim: int) -> dict:
    f32 = np.float32
    return {
        "written": ((num_envs,), np.int64),
        "obs": ((num_envs, capacity, obs_dim), f32),
        "next_obs": ((num_envs, capacity, obs_dim), f32),
        "actions": ((num_envs, capacity, act_dim), f32),
        "rewards": ((num_envs, capacity), f32),
        "terminated": ((num_envs, capacity), f32),
        "dones": ((num_envs, capacity), f32),
    }


class ReplayBuffer:
    """Per-env ring buffers in shared memory. Create in the learner, attach elsewhere."""

    def __init__(self, arrays: SharedArrays, spec: dict):
        self.mem, self.spec = arrays, spec
        self.num_envs, self.capacity = spec["num_envs"], spec["capacity"]
        for key in ("written", *FIELDS):
            setattr(self, key, arrays[key])

    @staticmethod
    def nbytes(num_envs: int, capacity: int, obs_dim: int, act_dim: int) -> int:
        """Bytes of shared memory a buffer of this shape takes."""
        return nbytes_of(_specs(num_envs, capacity, obs_dim, act_dim))

    @classmethod
    def create(cls, num_envs: int, capacity: int, obs_dim: int, act_dim: int) -> ReplayBuffer:
        """Allocate a buffer of `capacity` rows per env (so num_envs * capacity in total)."""
        spec = dict(num_envs=num_envs, capacity=capacity, obs_dim=obs_dim, act_dim=act_dim)
        arrays = SharedArrays.create(_specs(**spec), prefix="fastrl_replay")
        spec["name"] = arrays.name
        return cls(arrays, spec)

    @classmethod
    def attach(cls, spec: dict, untrack: bool = False) -> ReplayBuffer:
        """Map the buffer described by `spec` (the creator's `.spec`, a plain dict)."""
        shape = {k: spec[k] for k in ("num_envs", "capacity", "obs_dim", "act_dim")}
        return cls(SharedArrays.attach(spec["name"], _specs(**shape), untrack), spec)

    def write(self, envs: slice, step: int, obs, actions, rewards, next_obs, terminated, dones):
        """Write row `step` (an env-local step count, any size) of the envs in `envs`."""
        row = step % self.capacity
        self.obs[envs, row] = obs
        self.actions[envs, row] = actions
        self.rewards[envs, row] = rewards
        self.next_obs[envs, row] = next_obs
        self.terminated[envs, row] = terminated
        self.dones[envs, row] = dones

    def commit(self, envs: slice, written: int) -> None:
        """Publish that rows below env-local step `written` are complete for `envs`."""
        self.written[envs] = written

    def valid_range(self, written: int, window: int, n_step: int,
                    floor: int = 0) -> tuple[int, int]:
        """Env-local steps [lo, hi) that may start an n-step sample.

        Rows at or above `written` are not complete; the `window` rows after it may be
        overwritten by a write in flight, which in a ring lands on the oldest rows; and a
        start needs its n-1 successors written too. Steps below `floor` hold no data.
        """
        lo = max(floor, written + window - self.capacity)
        return lo, written - n_step + 1

    def sample(self, rng: np.random.Generator, batch_size: int, n_step: int, gamma: float,
               written: int, window: int = 0, floor: int = 0,
               out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Sample `batch_size` n-step transitions from env-local steps below `written`.

        Returns obs, actions, rewards (discounted n-step sum), next_obs (the observation
        after the last step used) and discounts (gamma**k, or 0 when that step terminated).
        Sums stop at the first episode end, so they never cross a reset. With `out` (arrays
        of the right shapes, e.g. views of pinned memory) the rows are gathered into it.
        """
        lo, hi = self.valid_range(written, window, n_step, floor)
        if hi <= lo:
            raise ValueError(f"nothing to sample: steps [{lo}, {hi}) with written={written}")
        env = rng.integers(0, self.num_envs, size=batch_size)
        start = rng.integers(lo, hi, size=batch_size)
        rows = (start[:, None] + np.arange(n_step)) % self.capacity  # [B, n]
        done = self.dones[env[:, None], rows]
        # alive[:, k] = 1 while no episode ended before step k of the window
        alive = np.ones_like(done)
        alive[:, 1:] = np.cumprod(1.0 - done[:, :-1], axis=1)
        discounts = gamma ** np.arange(n_step, dtype=np.float32)
        reward = (self.rewards[env[:, None], rows] * alive * discounts).sum(1)
        steps = alive.sum(1).astype(np.int64)  # transitions used, 1..n
        last = rows[np.arange(batch_size), steps - 1]
        bootstrap = (gamma**steps) * (1.0 - self.terminated[env, last])
        first, final = env * self.capacity + rows[:, 0], env * self.capacity + last
        out = out if out is not None else {}
        batch = {
            "obs": self._take(self.obs, first, out.get("obs")),
            "actions": self._take(self.actions, first, out.get("actions")),
            "rewards": reward.astype(np.float32),
            "next_obs": self._take(self.next_obs, final, out.get("next_obs")),
            "discounts": bootstrap.astype(np.float32),
        }
        for key in ("rewards", "discounts"):
            if key in out:
                out[key][:] = batch[key]
                batch[key] = out[key]
        return batch

    def _take(self, field: np.ndarray, flat_rows: np.ndarray, out: np.ndarray | None):
        """Rows of `field` at flat (env * capacity + row) indices, gathered into `out`."""
        flat = field.reshape(self.num_envs * self.capacity, -1)
        # (mode="clip": the indices are valid, and the default mode="raise" first gathers
        # into a temporary copy when `out` is given)
        return np.take(flat, flat_rows, axis=0, out=out, mode="clip")

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Observations of env-local steps [start, stop) of every env, flattened."""
        idx = np.arange(start, stop) % self.capacity
        return self.obs[:, idx].reshape(-1, self.obs.shape[-1])

    def save(self, path: str, written: int) -> None:
        """Write every row and the fill level `written` to `path` (.npz) atomically: via a
        temporary file and a rename, so a crash never leaves a half-written file."""
        with open(path + ".tmp", "wb") as f:
            np.savez(f, written=np.array(written), **{k: getattr(self, k) for k in FIELDS})
        os.replace(path + ".tmp", path)

    @staticmethod
    def file_is_whole(path: str) -> bool:
        """Whether `path` is a complete file written by `save` (a cut-off one lacks the zip
        directory at its end, or some fields)."""
        try:
            with zipfile.ZipFile(path) as z:
                names = set(z.namelist())
        except (OSError, zipfile.BadZipFile):
            return False
        return all(f"{k}.npy" in names for k in ("written", *FIELDS))

    def load(self, path: str) -> int:
        """Fill the rows from a file written by `save`; returns its fill level."""
        with np.load(path) as saved:
            for key in FIELDS:
                getattr(self, key)[:] = saved[key]
            return int(saved["written"])

    def close(self) -> None:
        """Unmap in this process."""
        self.written = self.obs = self.next_obs = self.actions = None
        self.rewards = self.terminated = self.dones = None
        self.mem.close()

    def unlink(self) -> None:
        """Remove the segment (creator only, once all users are done)."""
        self.mem.unlink()


def to_device(batch: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in batch.items()}


class Sampler:
    """Draws the learner's samples of `rows` n-step transitions and moves them to `device`.

    With `pinned` on CUDA the rows are gathered straight into pinned host memory and copied
    without blocking; two sets of buffers alternate, so gathering the next sample never
    overwrites one whose copy may still be in flight.
    """

    def __init__(self, rb: ReplayBuffer, rng: np.random.Generator, device, rows: int,
                 n_step: int, gamma: float, pinned: bool = False):
        self.rb, self.rng, self.device = rb, rng, device
        self.rows, self.n_step, self.gamma = rows, n_step, gamma
        self.pinned = []
        if pinned and device.type == "cuda":
            obs_dim, act_dim = rb.obs.shape[-1], rb.actions.shape[-1]
            shapes = {"obs": (rows, obs_dim), "next_obs": (rows, obs_dim),
                      "actions": (rows, act_dim), "rewards": (rows,), "discounts": (rows,)}
            self.pinned = [{k: torch.empty(v, pin_memory=True) for k, v in shapes.items()}
                           for _ in range(2)]
        self.turn = 0

    def __call__(self, written: int, window: int, floor: int) -> dict[str, torch.Tensor]:
        """A sample from env-local steps below `written` (see ReplayBuffer.sample)."""
        out = None
        if self.pinned:
            buffers = self.pinned[self.turn]
            self.turn ^= 1
            out = {k: v.numpy() for k, v in buffers.items()}
        batch = self.rb.sample(self.rng, self.rows, self.n_step, self.gamma, written, window,
                               floor, out)
        if self.pinned:
            return {k: v.to(self.device, non_blocking=True) for k, v in buffers.items()}
        return to_device(batch, self.device)
