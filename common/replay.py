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

import math
import time
import zipfile

import numpy as np
import torch

from common.shm import SharedArrays, nbytes_of, replacing
from common.trace import NO_TIMELINE

FIELDS = ("obs", "next_obs", "actions", "rewards", "terminated", "dones")


def _specs(num_envs: int, capacity: int, obs_dim: int, act_dim: int) -> dict:
    f32 = np.float32
    return {
        "written": ((num_envs,), np.int64),
        "amended": ((1,), np.int64),  # counts changes to committed rows (end_episodes)
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
        for key in ("written", "amended", *FIELDS):
            setattr(self, key, arrays[key])

    @staticmethod
    def nbytes(num_envs: int, capacity: int, obs_dim: int, act_dim: int) -> int:
        """Bytes of shared memory a buffer of this shape takes."""
        return nbytes_of(_specs(num_envs, capacity, obs_dim, act_dim))

    @classmethod
    def create(cls, num_envs: int, capacity: int, obs_dim: int, act_dim: int,
               prefix: str = "fastrl") -> ReplayBuffer:
        """Allocate a buffer of `capacity` rows per env (so num_envs * capacity in total), in
        the segment /dev/shm/{prefix}_replay_{pid}_{random}."""
        spec = dict(num_envs=num_envs, capacity=capacity, obs_dim=obs_dim, act_dim=act_dim)
        arrays = SharedArrays.create(_specs(**spec), prefix=f"{prefix}_replay")
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

    def end_episodes(self, envs: slice, step: int) -> None:
        """Mark env-local step `step` of `envs`, already committed, as an episode end (its
        collector died there), and count the change in `amended`: a device mirror, which
        never reads a committed row twice otherwise, copies the episode ends again."""
        self.dones[envs, step % self.capacity] = 1.0
        self.amended[0] += 1  # (after the write: a reader that sees the count sees the row)

    def valid_range(self, written: int, window: int, n_step: int,
                    floor: int = 0) -> tuple[int, int]:
        """Env-local steps [lo, hi) that may start an n-step sample.

        Rows at or above `written` are not complete; the `window` rows after it may be
        overwritten by a write in flight, which in a ring lands on the oldest rows; and a
        start needs its n-1 successors written too. Steps below `floor` hold no data.
        """
        lo = max(floor, written + window - self.capacity)
        return lo, written - n_step + 1

    def draw(self, rng: np.random.Generator, batch_size: int, n_step: int, written: int,
             window: int = 0, floor: int = 0) -> np.ndarray:
        """Random n-step windows below `written`: flat row indices (env * capacity + row),
        shape [batch_size, n_step], each row a window of consecutive steps of one env."""
        lo, hi = self.valid_range(written, window, n_step, floor)
        if hi <= lo:
            raise ValueError(f"nothing to sample: steps [{lo}, {hi}) with written={written}")
        env = rng.integers(0, self.num_envs, size=batch_size)
        start = rng.integers(lo, hi, size=batch_size)
        return env[:, None] * self.capacity + (start[:, None] + np.arange(n_step)) % self.capacity

    def sample(self, rng: np.random.Generator, batch_size: int, n_step: int, gamma: float,
               written: int, window: int = 0, floor: int = 0,
               out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Sample `batch_size` n-step transitions from env-local steps below `written`.

        Returns obs, actions, rewards (discounted n-step sum), next_obs (the observation
        after the last step used) and discounts (gamma**k, or 0 when that step terminated).
        Sums stop at the first episode end, so they never cross a reset. With `out` (arrays
        of the right shapes, e.g. views of pinned memory) the rows are gathered into it.
        """
        flat = self.draw(rng, batch_size, n_step, written, window, floor)
        fields = {k: torch.from_numpy(getattr(self, k).reshape(-1))
                  for k in ("rewards", "dones", "terminated")}
        rewards, discounts, last = nstep(torch.from_numpy(flat), fields, powers(gamma, n_step))
        out = out if out is not None else {}
        batch = {
            "obs": self._take(self.obs, flat[:, 0], out.get("obs")),
            "actions": self._take(self.actions, flat[:, 0], out.get("actions")),
            "rewards": rewards.numpy(),
            "next_obs": self._take(self.next_obs, last.numpy(), out.get("next_obs")),
            "discounts": discounts.numpy(),
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
        with replacing(path) as f:
            np.savez(f, written=np.array(written), **{k: getattr(self, k) for k in FIELDS})

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
        self.written = self.amended = self.obs = self.next_obs = self.actions = None
        self.rewards = self.terminated = self.dones = None
        self.mem.close()

    def unlink(self) -> None:
        """Remove the segment (creator only, once all users are done)."""
        self.mem.unlink()


def powers(gamma: float, n_step: int) -> torch.Tensor:
    """gamma**k for k = 0..n_step, as float32."""
    return torch.from_numpy((gamma ** np.arange(n_step + 1)).astype(np.float32))


def nstep(flat: torch.Tensor, fields: dict[str, torch.Tensor], gamma_pow: torch.Tensor):
    """The n-step sums of the windows `flat` [B, n] (see ReplayBuffer.draw) over the flat
    rewards, dones and terminated in `fields`: (discounted reward sum, bootstrap discount,
    flat row of the last step used). A sum stops after the first episode end; the discount
    is gamma**steps, or 0 when that last step terminated.

    The host sampler and the device mirror both use it, so their batches agree bit for bit.
    """
    done = fields["dones"][flat]
    alive = torch.ones_like(done)  # alive[:, k] = 1 while no episode ended before step k
    alive[:, 1:] = torch.cumprod(1.0 - done[:, :-1], dim=1)
    rewards = fields["rewards"][flat[:, 0]]
    for k in range(1, flat.shape[1]):  # (in order, the same sum on every device)
        rewards = rewards + fields["rewards"][flat[:, k]] * alive[:, k] * gamma_pow[k]
    steps = alive.sum(1).long()  # transitions used, 1..n
    last = flat.gather(1, (steps - 1)[:, None])[:, 0]
    return rewards, gamma_pow[steps] * (1.0 - fields["terminated"][last]), last


def to_device(batch: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in batch.items()}


def batch_shapes(rows: int, obs_dim: int, act_dim: int) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a sample of `rows` n-step transitions (all float32)."""
    return {"obs": (rows, obs_dim), "next_obs": (rows, obs_dim), "actions": (rows, act_dim),
            "rewards": (rows,), "discounts": (rows,)}


def batch_nbytes(rows: int, obs_dim: int, act_dim: int) -> int:
    """Bytes of one such sample (float32)."""
    return 4 * sum(math.prod(shape) for shape in batch_shapes(rows, obs_dim, act_dim).values())


def sample_buffers(rows: int, obs_dim: int, act_dim: int, device, pinned: bool = False):
    """Two sets of batch tensors to gather into, in turns: a fresh large array each time
    would cost more in page faults than the gather itself (measured in
    benchmarks/sample_time.py), and the set being filled is never the one in use."""
    shapes = batch_shapes(rows, obs_dim, act_dim)
    return [{k: torch.empty(v, device=device, pin_memory=pinned) for k, v in shapes.items()}
            for _ in range(2)]


class Sampler:
    """Draws the learner's samples of `rows` n-step transitions and moves them to `device`.

    The rows are gathered on the host into one of two sets of buffers, in turns. With
    `pinned` on CUDA they are pinned and copied on a side stream without blocking: the copy
    runs while the training already queued on the learner's stream runs, instead of queueing
    behind it, and that stream waits for the copy only where the batch is used. `seconds`
    sums the time spent here; `timeline` (--trace) records it as the learner's phases.
    """

    def __init__(self, rb: ReplayBuffer, rng: np.random.Generator, device, rows: int,
                 n_step: int, gamma: float, pinned: bool = False, timeline=NO_TIMELINE):
        self.rb, self.rng, self.device = rb, rng, device
        self.rows, self.n_step, self.gamma = rows, n_step, gamma
        self.timeline, self.seconds = timeline, 0.0
        pinned = pinned and device.type == "cuda"
        self.buffers = sample_buffers(rows, rb.obs.shape[-1], rb.actions.shape[-1], "cpu",
                                      pinned)
        self.stream = torch.cuda.Stream(device) if pinned else None
        # (one event per set of buffers: recorded after its copy, waited for before the
        # set is gathered into again, which waits for that copy only, never for training)
        self.copied = [torch.cuda.Event() for _ in self.buffers] if pinned else [None] * 2
        self.turn = 0

    def __call__(self, written: int, window: int, floor: int) -> dict[str, torch.Tensor]:
        """A sample from env-local steps below `written` (see ReplayBuffer.sample)."""
        t0, mark = time.perf_counter(), self.timeline.now()
        batch = self._gather(written, window, floor)
        self.timeline.phase("learner/gather", mark)
        self.seconds += time.perf_counter() - t0
        return batch

    def _gather(self, written: int, window: int, floor: int) -> dict[str, torch.Tensor]:
        buffers, copied = self.buffers[self.turn], self.copied[self.turn]
        self.turn ^= 1
        if copied is not None:
            copied.synchronize()  # (the copy from this set two samples ago)
        self.rb.sample(self.rng, self.rows, self.n_step, self.gamma, written, window, floor,
                       {k: v.numpy() for k, v in buffers.items()})
        if self.stream is None:
            return {k: v.to(self.device, non_blocking=True) for k, v in buffers.items()}
        with torch.cuda.stream(self.stream):  # from pinned memory: the host does not wait
            batch = {k: v.to(self.device, non_blocking=True) for k, v in buffers.items()}
            copied.record(self.stream)
        learner = torch.cuda.current_stream(self.device)
        learner.wait_stream(self.stream)  # (queued after this iteration's training)
        for v in batch.values():  # made on the side stream, used on the learner's: the
            v.record_stream(learner)  # allocator must not reuse it before that use is done
        return batch


class Mirror:
    """A copy of the replay rings in the learner's device memory (same per-env layout), and
    a sampler that gathers there: only the row indices cross from the host per sample.

    Before each sample it copies the rows committed since the previous one (num_envs x
    steps-per-iter rows per iteration; everything valid after a resume, so the shared
    buffer stays the source of truth). It never copies a row that a write in flight may
    touch: the same rows that sampling excludes (ReplayBuffer.valid_range). Rows committed
    earlier are copied again only when the buffer counts a change to them (`amended`, a
    collector restart's episode ends). Given the same random draws its batches equal
    Sampler's bit for bit.

    On CUDA nothing here waits for the device: the indices and the new rows are staged in
    pinned memory and copied with non_blocking=True, so the next sample is drawn and its
    gathers queued while the training queued before it still runs.
    """

    def __init__(self, rb: ReplayBuffer, rng: np.random.Generator, device, rows: int,
                 n_step: int, gamma: float, timeline=NO_TIMELINE):
        self.rb, self.rng, self.device = rb, rng, device
        self.rows, self.n_step = rows, n_step
        self.timeline, self.seconds = timeline, 0.0  # (as Sampler's)
        self.gamma_pow = powers(gamma, n_step).to(device)
        self.fields = {k: torch.zeros(getattr(rb, k).shape, device=device) for k in FIELDS}
        self.flat = {k: v.flatten(0, 1) for k, v in self.fields.items()}  # (views)
        self.upto = 0  # env-local steps below this that may be sampled are on the device
        self.amended = int(rb.amended[0])  # the buffer's count of changed committed rows
        self.buffers = sample_buffers(rows, rb.obs.shape[-1], rb.actions.shape[-1], device)
        self.turn = 0
        self.pinned = device.type == "cuda"

    @staticmethod
    def nbytes(num_envs: int, capacity: int, obs_dim: int, act_dim: int) -> int:
        """Device memory of a mirror of a buffer of this shape (its fields, not `written`)."""
        specs = _specs(num_envs, capacity, obs_dim, act_dim)
        return nbytes_of({k: specs[k] for k in FIELDS})

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        """`host` on the device, without waiting for it. On CUDA it is copied into pinned
        memory first: a copy from pageable memory would wait for all the work queued on the
        stream (the training just launched). The pinned block comes from the caching host
        allocator, which records the copy's event and hands the block out again only once
        that copy has completed, so dropping it here never lets it be overwritten early."""
        staged = torch.from_numpy(host)
        if self.pinned and host.nbytes <= 64 << 20:  # (a larger one is the one-off refill
            # after a resume: it may block, and pinning gigabytes would keep them pinned)
            staged = torch.empty(host.shape, dtype=staged.dtype, pin_memory=True)
            staged.numpy()[...] = host
        return staged.to(self.device, non_blocking=True)

    def _spans(self, lo: int, hi: int):
        """Env-local steps [lo, hi) as ring rows: at most two (start, stop) spans."""
        while lo < hi:
            row = lo % self.rb.capacity
            stop = min(self.rb.capacity, row + hi - lo)
            yield row, stop
            lo += stop - row

    def update(self, written: int, window: int, floor: int) -> None:
        """Copy env-local steps [upto, written) of every env, except those below the
        oldest step that may be sampled (they may be being overwritten); after a change to
        committed rows (`ReplayBuffer.end_episodes`), copy the episode ends of the rows
        already here again."""
        oldest = self.rb.valid_range(written, window, 1, floor)[0]
        amended = int(self.rb.amended[0])  # (read first: a later change is seen next time)
        if amended != self.amended:  # (rare: once per collector restart)
            for row, stop in self._spans(oldest, min(self.upto, written)):
                self.fields["dones"][:, row:stop].copy_(
                    self._to_device(np.ascontiguousarray(self.rb.dones[:, row:stop])))
            self.amended = amended
        for row, stop in self._spans(max(self.upto, oldest), written):
            for key, dst in self.fields.items():
                src = np.ascontiguousarray(getattr(self.rb, key)[:, row:stop])
                dst[:, row:stop].copy_(self._to_device(src))  # (device to device)
        self.upto = max(self.upto, written)

    def __call__(self, written: int, window: int, floor: int) -> dict[str, torch.Tensor]:
        """A sample from env-local steps below `written` (see ReplayBuffer.sample)."""
        # the draw first: it needs only the host, so it never waits behind the copies
        t0, mark = time.perf_counter(), self.timeline.now()
        flat = self.rb.draw(self.rng, self.rows, self.n_step, written, window, floor)
        self.update(written, window, floor)
        mark = self.timeline.phase("learner/mirror_copy", mark)
        flat = self._to_device(flat)
        rewards, discounts, last = nstep(flat, self.flat, self.gamma_pow)
        batch = self.buffers[self.turn]
        self.turn ^= 1  # (on CUDA the stream orders this gather after the last one's users)
        for key, rows in (("obs", flat[:, 0]), ("actions", flat[:, 0]), ("next_obs", last)):
            torch.index_select(self.flat[key], 0, rows, out=batch[key])
        batch["rewards"].copy_(rewards)
        batch["discounts"].copy_(discounts)
        self.timeline.phase("learner/gather", mark)
        self.seconds += time.perf_counter() - t0
        return batch
