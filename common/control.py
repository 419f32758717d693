"""Control: the small shared block through which a learner and its collectors coordinate.

One row per collector holds that collector's progress (chunks written), stop flag, state
and error text, timings, a ring of its finished episodes (return, length, env step, whether
it terminated, and the sums of the env's reward terms) that the learner reads for logging,
and with --trace a ring of timeline records (see trace.py). A `Control` object is bound to
one row (a collector uses its own); the learner also uses the methods that read or set every
row.
"""

from __future__ import annotations

import numpy as np

from common.shm import SharedArrays
from common.trace import RECORD, RingWriter, read_ring

RUNNING, FINISHED, FAILED = 0, 1, 2
EPISODE_RING = 4096
# an episode: return, length, env step at its end, terminated (1) or truncated (0), then the
# sums of up to MAX_REWARD_TERMS reward terms the env reports in info (reward_forward, ...)
MAX_REWARD_TERMS = 8
EPISODE_FIELDS = 4 + MAX_REWARD_TERMS
ERROR_BYTES = 16384
# indices into a row of the float64 "timing" array
COLLECT_S, WEIGHT_WAIT_S, WEIGHT_LOAD_S = 0, 1, 2
# indices into a row of the int64 "counters" array
CHUNKS_DONE, STOP, STATE, EPISODES, SNAPSHOT_REQ, SNAPSHOT_DONE, SNAPSHOT_CHUNK = range(7)
LEARNER_PID = 7  # (the same in every row) the learner that created the block
READ_CHUNK = 8  # (the same in every row) async: the chunks the learner's newest sample used
TRACE_COUNT = 9  # records written into the row's trace ring
VERSIONS = 10  # 4 entries: the weights version chunk c was collected with, at VERSIONS + c % 4


def _specs(num: int, trace_ring: int = 0) -> dict:
    return {
        "counters": ((num, 14), np.int64),
        "timing": ((num, 4), np.float64),
        "episodes": ((num, EPISODE_RING, EPISODE_FIELDS), np.float64),
        "error": ((num, ERROR_BYTES), np.uint8),
        "trace": ((num, trace_ring, RECORD), np.int64),
    }


def _field(index: int):
    return property(lambda self: int(self.counters[index]),
                    lambda self, v: self.counters.__setitem__(index, int(v)))


class Control:
    """Progress, stop flags, errors and episode statistics shared by learner and collectors."""

    def __init__(self, arrays: SharedArrays, index: int = 0):
        self.mem, self.index = arrays, index
        self.num, self.trace_ring = arrays["counters"].shape[0], arrays["trace"].shape[1]
        self.spec = {"name": arrays.name, "num": self.num, "trace_ring": self.trace_ring}
        self.all_counters, self.all_timing = arrays["counters"], arrays["timing"]
        self.counters, self.timing = self.all_counters[index], self.all_timing[index]
        self.episode_ring, self.error = arrays["episodes"][index], arrays["error"][index]
        self.trace = arrays["trace"][index]

    @classmethod
    def create(cls, num: int = 1, trace_ring: int = 0, prefix: str = "fastrl") -> Control:
        """Allocate a zeroed block with a row for each of `num` collectors (and a trace ring
        of `trace_ring` records in each; 0: no tracing)."""
        return cls(SharedArrays.create(_specs(num, trace_ring), prefix=f"{prefix}_ctrl"))

    @classmethod
    def attach(cls, spec: dict, index: int = 0, untrack: bool = False) -> Control:
        """Map the block named in `spec`, bound to row `index`."""
        specs = _specs(spec["num"], spec.get("trace_ring", 0))
        return cls(SharedArrays.attach(spec["name"], specs, untrack), index)

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

    def log_episode(self, ret: float, length: int, env_step: int, terminated: bool = False,
                    reward_terms=()) -> None:
        """Append a finished episode (oldest entries are overwritten after EPISODE_RING);
        `reward_terms`: the episode's sums of the env's reward terms (at most
        MAX_REWARD_TERMS, in the order the collector and the learner agreed on)."""
        n = int(self.counters[EPISODES])
        row = self.episode_ring[n % EPISODE_RING]
        row[:4] = (ret, length, env_step, terminated)
        row[4:4 + len(reward_terms)] = reward_terms
        self.counters[EPISODES] = n + 1

    def episodes_since(self, seen: int) -> tuple[int, np.ndarray]:
        """Episodes this row logged after the first `seen`: (new count, rows of return,
        length, env step, terminated, reward terms...)."""
        n = int(self.counters[EPISODES])
        first = max(seen, n - EPISODE_RING)
        idx = np.arange(first, n) % EPISODE_RING
        return n, self.episode_ring[idx].copy()

    def set_chunk_version(self, chunk: int, version: int) -> None:
        """The weights version `chunk` was collected with (kept for the newest 4 chunks: a
        collector is at most one chunk ahead of the chunks the learner reads)."""
        self.counters[VERSIONS + chunk % 4] = version + 1  # (0: not collected in this run)

    def trace_writer(self) -> RingWriter:
        """The collector's writer into its trace ring (see trace.py)."""
        return RingWriter(self.trace, self.counters, TRACE_COUNT)

    def trace_since(self, seen: int) -> tuple[int, np.ndarray, int]:
        """Trace records written after the first `seen`: (new count, records, lost ones)."""
        return read_ring(self.trace, self.counters, TRACE_COUNT, seen)

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

    def chunk_versions(self, chunk: int) -> np.ndarray:
        """Every collector's weights version for `chunk` (one of its newest 4; -1 where it
        was not collected by this run, as before a resume)."""
        return self.all_counters[:, VERSIONS + chunk % 4] - 1

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
        self.episode_ring = self.error = self.trace = None
        self.mem.close()

    def unlink(self) -> None:
        """Remove the segment (creator only)."""
        self.mem.unlink()
