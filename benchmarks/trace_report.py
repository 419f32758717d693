"""Read a --trace timeline without a browser: where each process spends its time, and a PNG.

    python benchmarks/trace_report.py runs/Humanoid-v5__fast_sac__1__*/trace.json
    python benchmarks/trace_report.py RUN/trace.json --png timeline.png --seconds 2

The table gives, per process, the share of wall time in each phase (self time: a slice's
time minus the slices nested in it, so the shares of a process add up to at most 100%; the
rest is time no phase covers), and how much of the learner's busy time (everything but
waiting for data) each collector was busy too: the overlap that pipelining buys. The PNG
draws a few seconds of it, one lane per process, slices coloured by phase.

A trace keeps the first and the newest records of a long run; by default the report reads
the newest part (--part first or all to change that). Several files (one per torchrun rank)
are read together: they share one clock.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

import tyro


@dataclass
class Report:
    traces: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """trace.json files (several: the ranks of one run)"""
    part: str = "newest"
    """which records to read: newest (after the gap where records were left out), first
    (before it) or all"""
    png: str | None = None
    """also draw a timeline PNG here"""
    seconds: float = 2.0
    """--png: how many seconds to draw"""
    start: float | None = None
    """--png: where the drawing starts, in seconds from the start of the part read
    (default: the middle --seconds of it, away from start-up and the final evaluation)"""


EPS = 1e-3  # microseconds: times are nanoseconds / 1000 in floats, so an end can exceed the
# next start by a rounding error
# phases that are waiting rather than work, for the overlap figure
WAITS = ("wait_for_data", "wait_for_weights", "barrier", "allreduce_min", "any_rank")


def load(paths: list[str]) -> tuple[dict[int, str], list[dict], int]:
    """(process labels by pid, complete-slice events, records left out) of the files."""
    labels, events, left_out = {}, [], 0
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for e in data["traceEvents"]:
            if e["ph"] == "M" and e["name"] == "thread_name":
                labels[e["pid"], e.get("tid", 0)] = e["args"]["name"]
            elif e["ph"] == "X":
                events.append(e)
        left_out += sum(data.get("otherData", {}).get("records_left_out", {}).values())
    return labels, events, left_out


def split_at_gap(events: list[dict], part: str, left_out: int) -> tuple[float, float]:
    """The time range of the part to read: records were left out between the first and
    the newest ones, so the widest pause between the learner's slices marks the cut."""
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    if part == "all" or not left_out:
        return t0, t1
    learner = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e["name"].startswith("learner/"))
    end, gap = learner[0][1], (0.0, t0, t0)
    for start, stop in learner[1:]:
        if start - end > gap[0]:
            gap = (start - end, end, start)
        end = max(end, stop)
    return (gap[2], t1) if part == "newest" else (t0, gap[1])


def self_times(track: list[dict], lo: float, hi: float) -> dict[str, float]:
    """Per phase, the time of its slices within [lo, hi] minus that of slices nested in them."""
    out = defaultdict(float)
    stack: list[list] = []  # [end, name]
    for e in sorted(track, key=lambda e: (e["ts"], -e["dur"])):
        start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        while stack and stack[-1][0] <= e["ts"] + EPS:
            stack.pop()
        if end <= start:
            continue
        out[e["name"]] += end - start
        if stack:  # nested: not the parent's own time
            out[stack[-1][1]] -= end - start
        stack.append([e["ts"] + e["dur"], e["name"]])
    return out


def busy(track: list[dict], lo: float, hi: float) -> list[tuple[float, float]]:
    """Merged intervals in [lo, hi] where the process is in a phase that is not a wait."""
    spans = sorted((max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in track
                   if not e["name"].endswith(WAITS) and e["ts"] < hi and e["ts"] + e["dur"] > lo)
    merged: list[list[float]] = []
    for a, b in spans:  # (a wait nested in a busy slice is covered by it: busy)
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def by_track(labels: dict, events: list[dict], lo: float, hi: float) -> tuple[dict, list]:
    """The slices that reach into [lo, hi), per track, and the tracks in order: the learner
    first, then by name."""
    tracks = defaultdict(list)
    for e in events:
        if e["ts"] < hi and e["ts"] + e["dur"] > lo:
            tracks[e["pid"], e.get("tid", 0)].append(e)
    order = sorted(tracks, key=lambda k: (not labels.get(k, "").startswith("learner"),
                                          labels.get(k, ""), k))
    return tracks, order


def table(labels: dict, events: list[dict], lo: float, hi: float) -> str:
    tracks, order = by_track(labels, events, lo, hi)
    lines = [f"{(hi - lo) / 1e6:.2f} s of the run read; per process, the share of the time "
             "it recorded in each phase (self time)", ""]
    learner_busy = None
    for key in order:
        name, track = labels.get(key, str(key)), tracks[key]
        # each process's own stretch (the newest records of a busier process start later)
        t0 = max(lo, min(e["ts"] for e in track))
        t1 = min(hi, max(e["ts"] + e["dur"] for e in track))
        wall = max(t1 - t0, 1e-9)
        times = self_times(track, t0, t1)
        lines.append(f"{name} ({wall / 1e6:.2f} s)")
        for phase, t in sorted(times.items(), key=lambda kv: -kv[1]):
            if t > 0.0005 * wall:
                lines.append(f"  {phase.split('/', 1)[-1]:<22} {100 * t / wall:6.1f} %")
        rest = max(0.0, wall - sum(times.values()))
        lines.append(f"  {'(no phase)':<22} {100 * rest / wall:6.1f} %")
        intervals = busy(track, t0, t1)
        if name.startswith("learner") and learner_busy is None:
            learner_busy = intervals
        elif learner_busy and not name.startswith("learner"):
            mine = [(max(a, t0), min(b, t1)) for a, b in learner_busy if b > t0 and a < t1]
            if mine:
                share = overlap(mine, intervals) / sum(b - a for a, b in mine)
                lines.append(f"  busy during {100 * share:.1f} % of the learner's busy time")
        lines.append("")
    return "\n".join(lines)


def draw(path: str, labels: dict, events: list[dict], lo: float, hi: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tracks, order = by_track(labels, events, lo, hi)
    phases = sorted({e["name"] for t in tracks.values() for e in t})
    colours = iter([*plt.get_cmap("tab10").colors, *plt.get_cmap("Dark2").colors,
                    *plt.get_cmap("Set2").colors] * 2)
    # waiting is grey and a chunk (the container of a collector's steps) pale, so the work
    # stands out
    colour = {p: "0.82" if p.endswith(WAITS) else "0.93" if p.endswith("collect_chunk")
              else next(colours) for p in phases}
    fig, ax = plt.subplots(figsize=(13, max(3.0, 0.8 + 0.7 * len(order))))
    for lane, key in enumerate(order):
        y = len(order) - 1 - lane
        stack: list[float] = []
        for e in sorted(tracks[key], key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"] + EPS:
                stack.pop()
            depth = min(len(stack), 2)  # nested slices: thinner bars on top of their parent
            height = 0.8 * (1 - 0.3 * depth)
            start = (max(e["ts"], lo) - lo) / 1e3
            width = (min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) / 1e3
            ax.broken_barh([(start, width)], (y - height / 2, height),
                           facecolors=colour[e["name"]], linewidth=0)
            stack.append(e["ts"] + e["dur"])
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([labels.get(k, str(k)) for k in reversed(order)])
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("milliseconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[p]) for p in phases]
    ax.legend(handles, phases, fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1),
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(r: Report) -> None:
    if not r.traces:
        raise SystemExit("give at least one trace.json")
    if r.part not in ("newest", "first", "all"):
        raise SystemExit(f"--part is newest, first or all, not {r.part}")
    labels, events, left_out = load(r.traces)
    if not events:
        raise SystemExit(f"{r.traces} hold no slices")
    lo, hi = split_at_gap(events, r.part, left_out)
    print(table(labels, events, lo, hi))
    if r.png:
        middle = (lo + hi) / 2 - r.seconds * 1e6 / 2
        start = middle if r.start is None else lo + r.start * 1e6
        start = max(lo, start)
        draw(r.png, labels, events, start, min(hi, start + r.seconds * 1e6))
        print(f"wrote {r.png}")


if __name__ == "__main__":
    main(tyro.cli(Report))
