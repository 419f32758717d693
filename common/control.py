"""Control: the small shared block through which a learner and its collector coordinate.

It holds the collector's progress (chunks written), a stop flag, the collector's state and
error text, timings, and a ring of finished episodes (return, length, env step) that the
learner reads for logging.
"""

from __future__ import annotations

import numpy as np

from common.shm import SharedArrays

RUNNING, FINISHED, FAILED = 0, 1, 2
EPISODE_RING = 4096
ERROR_BYTES = 16384
# indices into the float64 "timing" array
COLLECT_S, WEIGHT_WAIT_S, WEIGHT_LOAD_S = 0, 1, 2

SPECS = {
    # chunks_done, stop, state, episodes, snapshot_req, snapshot_done
    "counters": ((8,), np.int64),
    "timing": ((4,), np.float64),
    "episodes": ((EPISODE_RING, 3), np.float64),
    "error": ((ERROR_BYTES,), np.uint8),
}


class Control:
    """Progress, stop flag, errors and episode statistics shared by learner and collector."""

    def __init__(self, arrays: SharedArrays):
        self.mem, self.spec = arrays, {"name": arrays.name}
        self.counters, self.timing = arrays["counters"], arrays["timing"]
        self.episode_ring, self.error = arrays["episodes"], arrays["error"]

    @classmethod
    def create(cls) -> Control:
        """Allocate a zeroed block."""
        return cls(SharedArrays.create(SPECS, prefix="fastrl_ctrl"))

    @classmethod
    def attach(cls, spec: dict, untrack: bool = False) -> Control:
        """Map the block named in `spec`."""
        return cls(SharedArrays.attach(spec["name"], SPECS, untrack))

    chunks_done = property(lambda self: int(self.counters[0]),
                           lambda self, v: self.counters.__setitem__(0, v))
    stop = property(lambda self: bool(self.counters[1]),
                    lambda self, v: self.counters.__setitem__(1, int(v)))
    state = property(lambda self: int(self.counters[2]),
                     lambda self, v: self.counters.__setitem__(2, v))
    # the learner raises snapshot_req to ask the collector for its state; the collector
    # sets snapshot_done to the same number once the state file is written
    snapshot_req = property(lambda self: int(self.counters[4]),
                            lambda self, v: self.counters.__setitem__(4, v))
    snapshot_done = property(lambda self: int(self.counters[5]),
                             lambda self, v: self.counters.__setitem__(5, v))
    # the chunk at whose start the snapshot is taken (the collector takes it at the first
    # chunk at or after this one)
    snapshot_chunk = property(lambda self: int(self.counters[6]),
                              lambda self, v: self.counters.__setitem__(6, v))

    def fail(self, text: str) -> None:
        """Record the collector's error text and mark it failed."""
        data = text.encode()[-ERROR_BYTES:]
        self.error[: len(data)] = np.frombuffer(data, np.uint8)
        self.state = FAILED

    def error_text(self) -> str:
        """The error recorded by `fail`, or ''."""
        return bytes(self.error).rstrip(b"\0").decode(errors="replace")

    def log_episode(self, ret: float, length: int, env_step: int) -> None:
        """Append a finished episode (oldest entries are overwritten after EPISODE_RING)."""
        n = int(self.counters[3])
        self.episode_ring[n % EPISODE_RING] = (ret, length, env_step)
        self.counters[3] = n + 1

    def episodes_since(self, seen: int) -> tuple[int, np.ndarray]:
        """Episodes logged after the first `seen`: (new count, rows of return/length/step)."""
        n = int(self.counters[3])
        first = max(seen, n - EPISODE_RING)
        idx = np.arange(first, n) % EPISODE_RING
        return n, self.episode_ring[idx].copy()

    def close(self) -> None:
        """Unmap in this process."""
        self.counters = self.timing = self.episode_ring = self.error = None
        self.mem.close()

    def unlink(self) -> None:
        """Remove the segment (creator only)."""
        self.mem.unlink()
