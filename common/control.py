"""Control: the small shared block through which a learner and its collectors coordinate.

One row per collector holds that collector's progress (chunks written), stop flag, state
and error text, timings, and a ring of its finished episodes (return, length, env step)
that the learner reads for logging. A `Control` object is bound to one row (a collector
uses its own); the learner also uses the methods that read or set every row.
"""

from __future__ import annotations

import numpy as np

from common.shm import SharedArrays

RUNNING, FINISHED, FAILED = 0, 1, 2
EPISODE_RING = 4096
ERROR_BYTES = 16384
# indices into a row of the float64 "timing" array
COLLECT_S, WEIGHT_WAIT_S, WEIGHT_LOAD_S = 0, 1, 2
# indices into a row of the int64 "counters" array
CHUNKS_DONE, STOP, STATE, EPISODES, SNAPSHOT_REQ, SNAPSHOT_DONE, SNAPSHOT_CHUNK = range(7)
LEARNER_PID = 7  # (the same in every row) the learner that created the block
READ_CHUNK = 8  # (the same in every row) async: the chunks the learner's newest sample used


def _specs(num: int) -> dict:
    return {
        "counters": ((num, 9), np.int64),
        "timing": ((num, 4), np.float64),
        "episodes": ((num, EPISODE_RING, 3), np.float64),
        "error": ((num, ERROR_BYTES), np.uint8),
    }


def _field(index: int):
    return property(lambda self: int(self.counters[index]),
                    lambda self, v: self.counters.__setitem__(index, int(v)))


class Control:
    """Progress, stop flags, errors and episode statistics shared by learner and collectors."""

    def __init__(self, arrays: SharedArrays, index: int = 0):
        self.mem, self.index = arrays, index
        self.num = arrays["counters"].shape[0]
        self.spec = {"name": arrays.name, "num": self.num}
        self.all_counters, self.all_timing = arrays["counters"], arrays["timing"]
        self.counters, self.timing = self.all_counters[index], self.all_timing[index]
        self.episode_ring, self.error = arrays["episodes"][index], arrays["error"][index]

    @classmethod
    def create(cls, num: int = 1) -> Control:
        """Allocate a zeroed block with a row for each of `num` collectors."""
        return cls(SharedArrays.create(_specs(num), prefix="fastrl_ctrl"))

    @classmethod
    def attach(cls, spec: dict, index: int = 0, untrack: bool = False) -> Control:
        """Map the block named in `spec`, bound to row `index`."""
        return cls(SharedArrays.attach(spec["name"], _specs(spec["num"]), untrack), index)

    def row(self, index: int) -> Control:
        """The same mapping, bound to another collector's row (close only the original)."""
        return Control(self.mem, index)

    # one collector's row
    chunks_done = _field(CHUNKS_DONE)
    stop = property(lambda self: bool(self.counters[STOP]),
                    lambda self, v: self.counters.__setitem__(STOP, int(v)))
    state = _field(STATE)
    # the learner raises snapshot_req to ask the collector for its state; the collector
    # sets snapshot_done to the same number once the state file is written
    snapshot_req = _field(SNAPSHOT_REQ)
    snapshot_done = _field(SNAPSHOT_DONE)
    # the chunk at whose start the snapshot is taken (the collector takes it at the first
    # chunk at or after this one)
    snapshot_chunk = _field(SNAPSHOT_CHUNK)

    def fail(self, text: str) -> None:
        """Record the collector's error text and mark it failed."""
        data = text.encode()[-ERROR_BYTES:]
        self.error[:] = 0
        self.error[: len(data)] = np.frombuffer(data, np.uint8)
        self.state = FAILED

    def error_text(self) -> str:
        """The error recorded by `fail`, or ''."""
        return bytes(self.error).rstrip(b"\0").decode(errors="replace")

    def log_episode(self, ret: float, length: int, env_step: int) -> None:
        """Append a finished episode (oldest entries are overwritten after EPISODE_RING)."""
        n = int(self.counters[EPISODES])
        self.episode_ring[n % EPISODE_RING] = (ret, length, env_step)
        self.counters[EPISODES] = n + 1

    def episodes_since(self, seen: int) -> tuple[int, np.ndarray]:
        """Episodes this row logged after the first `seen`: (new count, return/length/step)."""
        n = int(self.counters[EPISODES])
        first = max(seen, n - EPISODE_RING)
        idx = np.arange(first, n) % EPISODE_RING
        return n, self.episode_ring[idx].copy()

    # every row (the learner's view)
    def slowest(self) -> int:
        """Chunks completed by every collector."""
        return int(self.all_counters[:, CHUNKS_DONE].min())

    @property
    def read_chunk(self) -> int:
        """How many chunks the learner's newest sample was drawn from (async mode)."""
        return int(self.counters[READ_CHUNK])

    def set_read_chunk(self, chunks: int) -> None:
        self.all_counters[:, READ_CHUNK] = chunks

    def stop_all(self) -> None:
        self.all_counters[:, STOP] = 1

    def ask_snapshot(self, chunk: int) -> None:
        """Ask every collector for its state at the start of `chunk` (or the first after)."""
        self.all_counters[:, SNAPSHOT_CHUNK] = chunk
        self.all_counters[:, SNAPSHOT_REQ] += 1

    def snapshots_taken(self) -> bool:
        c = self.all_counters
        return bool((c[:, SNAPSHOT_DONE] == c[:, SNAPSHOT_REQ]).all())

    def all_episodes_since(self, seen: list[int]) -> tuple[list[int], np.ndarray]:
        """`episodes_since` over every row; `seen` has one count per row."""
        counts, rows = zip(*(self.row(i).episodes_since(s) for i, s in enumerate(seen)))
        return list(counts), np.concatenate(rows)

    def mean_timing(self) -> np.ndarray:
        """Timings averaged over the collectors (each collector is busy in parallel)."""
        return self.all_timing.mean(0)

    def close(self) -> None:
        """Unmap in this process."""
        self.all_counters = self.all_timing = self.counters = self.timing = None
        self.episode_ring = self.error = None
        self.mem.close()

    def unlink(self) -> None:
        """Remove the segment (creator only)."""
        self.mem.unlink()
