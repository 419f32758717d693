"""--trace: a timeline of the learner and every collector, as a Chrome trace event file.

Every process records its phases (name, start, duration) on CLOCK_MONOTONIC, which all
processes of a machine share, so the tracks line up without any clock exchange. The
learner keeps its records in a `Timeline`; a collector writes fixed-size records into its
row of the Control block (`TraceRing`, see control.py), from which the learner drains them
into one Timeline per collector. `Trace.write` turns all of them into one JSON file that
Perfetto (ui.perfetto.dev) and chrome://tracing open.

Each Timeline is bounded: it keeps its first `keep // 2` records and its newest
`keep - keep // 2`, so a day-long run writes a file of the same size as a short one.
When tracing is off the scripts use `NO_TIMELINE`, whose methods do nothing.
"""

from __future__ import annotations

import collections
import json
import os
import time

from common.shm import replacing

now_ns = time.monotonic_ns  # CLOCK_MONOTONIC on Linux: one clock for every process

# a collector's phases, by the code it writes into its ring (the harness records them)
COLLECTOR_PHASES = ("collector/wait_for_weights", "collector/load_weights",
                    "collector/collect_chunk", "collector/act", "collector/env_step",
                    "collector/write_rows", "collector/commit", "collector/snapshot",
                    "collector/chunk")  # the last one is a counter: the chunk it is on
(WAIT_WEIGHTS, LOAD_WEIGHTS, COLLECT_CHUNK, ACT, ENV_STEP, WRITE_ROWS, COMMIT, SNAPSHOT,
 CHUNK_COUNTER) = range(len(COLLECTOR_PHASES))
RECORD = 4  # a ring record: code, start ns, duration ns (-1: a counter), value
ARG_NAMES = {LOAD_WEIGHTS: "version", COLLECT_CHUNK: "chunk"}  # what a slice's value means


class _Span:
    """`with timeline.span(name):` records the block as one slice."""

    __slots__ = ("timeline", "name", "args", "t0")

    def __init__(self, timeline, name, args):
        self.timeline, self.name, self.args = timeline, name, args

    def __enter__(self):
        self.t0 = now_ns()
        return self

    def __exit__(self, *exc):
        self.timeline.add((self.name, self.t0, now_ns() - self.t0, self.args))
        return False


class _NoSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SPAN = _NoSpan()


class Timeline:
    """One track's records (name, start ns, duration ns or None for a counter, args), the
    first `keep // 2` and the newest rest. `dropped` counts the records left out between."""

    def __init__(self, keep: int, label: str, pid: int, tid: int = 0):
        self.label, self.pid, self.tid = label, pid, tid
        self.head_cap = keep // 2
        self.head, self.tail = [], collections.deque(maxlen=keep - keep // 2)
        self.dropped = 0
        self.events = None  # on CUDA: CudaEvents, device slices of the `phase` chains

    def add(self, record: tuple) -> None:
        if len(self.head) < self.head_cap:
            self.head.append(record)
            return
        if len(self.tail) == self.tail.maxlen:
            self.dropped += 1
        self.tail.append(record)

    def span(self, name: str, args: dict | None = None) -> _Span:
        """A context manager that records its block as the slice `name`."""
        return _Span(self, name, args)

    def phase(self, name: str, t0: int, args: dict | None = None) -> int:
        """Record the slice `name` from `t0` (ns, from `now` or the previous `phase`) to now;
        returns now, where the next phase of a chain starts (one clock read per phase)."""
        t1 = now_ns()
        self.add((name, t0, t1 - t0, args))
        if self.events is not None:
            self.events.phase(name, t0, t1)
        return t1

    def counter(self, name: str, value: float) -> None:
        self.add((name, now_ns(), None, value))

    def now(self) -> int:
        t = now_ns()
        if self.events is not None:
            self.events.mark(t)
        return t

    def records(self) -> list[tuple]:
        return self.head + list(self.tail)


class CudaEvents:
    """Device time on CUDA, where kernels run after the host launched them: a CUDA event is
    recorded at each point of a `phase` chain, and `resolve` (when logging is due: one
    sync, never one per update) turns the pairs into slices on the device track, placed on
    the host clock by an anchor event recorded and waited for right then."""

    def __init__(self, device_timeline: Timeline):
        import torch

        self.cuda, self.timeline = torch.cuda, device_timeline
        self.at: dict[int, object] = {}  # host time of a chain point -> its event
        self.pending: list[tuple] = []

    def _record(self):
        event = self.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, t: int) -> None:
        self.at[t] = self._record()

    def phase(self, name: str, t0: int, t1: int) -> None:
        end = self._record()
        self.at[t1] = end
        start = self.at.pop(t0, None)
        if start is not None:
            self.pending.append((name, start, end))

    def resolve(self) -> None:
        if not self.pending:
            return
        anchor = self._record()
        anchor.synchronize()
        t = now_ns()
        for name, start, end in self.pending:
            begin = t - int(start.elapsed_time(anchor) * 1e6)
            self.timeline.add((name, begin, int(start.elapsed_time(end) * 1e6), None))
        self.pending.clear()
        self.at.clear()


class NoTimeline:
    """Tracing off: every method does nothing (and records nothing)."""

    def span(self, name, args=None):
        return _NO_SPAN

    def phase(self, name, t0, args=None):
        return 0

    def counter(self, name, value):
        pass

    @staticmethod
    def now():
        return 0

    def add(self, record):
        pass


NO_TIMELINE = NoTimeline()


class RingWriter:
    """A collector's side of its trace ring (a row of the Control block): records go to
    shared memory, where the learner reads them. The ring overwrites its oldest records
    when the learner falls more than a ring behind."""

    def __init__(self, ring, counters, count_index: int):
        self.ring, self.counters, self.count_index = ring, counters, count_index
        self.size = ring.shape[0]

    def _put(self, code: int, t0: int, dur: int, value: int) -> None:
        n = int(self.counters[self.count_index])
        self.ring[n % self.size] = (code, t0, dur, value)
        self.counters[self.count_index] = n + 1  # (after the record: the reader never
        # sees a count whose record is not written yet)

    def phase(self, code: int, t0: int, value: int = -1) -> int:
        t1 = now_ns()
        self._put(code, t0, t1 - t0, value)
        return t1

    def counter(self, code: int, value: int) -> None:
        self._put(code, now_ns(), -1, value)

    def slice(self, code: int, t0: int, t1: int, value: int = -1) -> None:
        """A slice whose end the caller read (before it told the learner the work is done,
        so that the learner's later slices never start before this one ends)."""
        self._put(code, t0, t1 - t0, value)

    @staticmethod
    def now() -> int:
        return now_ns()


class NoRingWriter:
    def phase(self, code, t0, value=-1):
        return 0

    def counter(self, code, value):
        pass

    def slice(self, code, t0, t1, value=-1):
        pass

    @staticmethod
    def now():
        return 0


NO_RING_WRITER = NoRingWriter()


def read_ring(ring, counters, count_index: int, seen: int):
    """Records written after the first `seen`: (new count, records [n, 4], lost records)."""
    n = int(counters[count_index])
    first = max(seen, n - ring.shape[0])
    idx = [i % ring.shape[0] for i in range(first, n)]
    return n, ring[idx].copy(), first - seen


class Trace:
    """The learner's side: its own Timeline (and, on CUDA, a device track), the collectors'
    Timelines filled from their rings, and the file."""

    def __init__(self, keep: int, label: str = "learner", cuda: bool = False):
        pid = os.getpid()
        self.keep = keep
        self.learner = Timeline(keep, label, pid)
        self.device = Timeline(keep, f"{label} (CUDA device)", pid, tid=1) if cuda else None
        if cuda:
            self.learner.events = CudaEvents(self.device)
        self.collectors: dict[int, Timeline] = {}
        self.seen: dict[int, int] = {}
        self.lost = 0

    def drain(self, ctrl, pids: list[int | None]) -> None:
        """Move the records the collectors wrote since the last call into their Timelines.
        `pids`: the collectors' process ids (a restarted collector keeps its track)."""
        for i, pid in enumerate(pids):
            if i not in self.collectors:
                self.collectors[i] = Timeline(self.keep, f"collector {i}", pid or -1 - i)
                self.seen[i] = 0
            self.seen[i], records, lost = ctrl.row(i).trace_since(self.seen[i])
            self.lost += lost
            timeline = self.collectors[i]
            for code, t0, dur, value in records.tolist():
                name = COLLECTOR_PHASES[code]
                if dur < 0:
                    timeline.add((name, t0, None, value))
                else:
                    args = {ARG_NAMES[code]: value} if code in ARG_NAMES else None
                    timeline.add((name, t0, dur, args))

    def resolve_device(self) -> None:
        """On CUDA: wait for the device once and put its slices on the device track."""
        if self.device is not None:
            self.learner.events.resolve()

    def timelines(self) -> list[Timeline]:
        return [t for t in (self.learner, self.device, *self.collectors.values()) if t]

    def write(self, path: str, extra: dict | None = None) -> None:
        """The Chrome trace event JSON (times in microseconds), via a rename."""
        self.resolve_device()
        events = []
        for tl in self.timelines():
            events.append({"ph": "M", "name": "process_name", "pid": tl.pid,
                           "args": {"name": tl.label.split(" (")[0]}})
            events.append({"ph": "M", "name": "thread_name", "pid": tl.pid, "tid": tl.tid,
                           "args": {"name": tl.label}})
            for name, t0, dur, args in tl.records():
                if dur is None:
                    events.append({"ph": "C", "name": name.split("/")[-1], "pid": tl.pid,
                                   "ts": t0 / 1e3, "args": {"value": args}})
                    continue
                event = {"ph": "X", "name": name, "cat": name.split("/")[0], "pid": tl.pid,
                         "tid": tl.tid, "ts": t0 / 1e3, "dur": dur / 1e3}
                if args:
                    event["args"] = args
                events.append(event)
        dropped = {tl.label: tl.dropped for tl in self.timelines()}
        data = {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"clock": "CLOCK_MONOTONIC", "records_kept_per_track": self.keep,
                              "records_left_out": dropped, "collector_records_lost": self.lost,
                              **(extra or {})}}
        with replacing(path, "w") as f:
            json.dump(data, f)
