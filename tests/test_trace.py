"""--trace: the timeline file of real short runs (real collector processes, real shared
memory), and the bounded record keeping behind it."""

import json
import os
from collections import defaultdict

import pytest
from conftest import ORIGINALS, SMALL, run_script, script_file

from common.trace import NO_TIMELINE, Timeline

pytestmark = pytest.mark.script("fast_sac.py")

LEARNER_SLICES = {"learner/wait_for_data", "learner/normalizer_update", "learner/replay_sample",
                  "learner/normalize_batch", "learner/update_critic", "learner/update_actor",
                  "learner/target_update", "learner/check_finite", "learner/weight_sync_write",
                  "learner/log", "learner/evaluate"}
COLLECTOR_SLICES = {"collector/wait_for_weights", "collector/load_weights",
                    "collector/collect_chunk", "collector/act", "collector/env_step",
                    "collector/write_rows", "collector/commit"}
EPS = 1e-3  # microseconds: the file's times are nanoseconds / 1000 as floats


def load_trace(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    for e in events:  # the fields the trace event format asks for
        assert e["ph"] in ("X", "C", "M") and isinstance(e["pid"], int) and e["name"]
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0 and e["ts"] > 0
            assert e["pid"] in names
        if e["ph"] == "C":
            assert isinstance(e["args"]["value"], (int, float))
    return data, events, names


def slices(events, pid=None, name=None):
    return [e for e in events if e["ph"] == "X" and (pid is None or e["pid"] == pid)
            and (name is None or e["name"] == name)]


def assert_nested_or_apart(events):
    """On each track (pid, tid), two slices are either disjoint or one contains the other."""
    tracks = defaultdict(list)
    for e in slices(events):
        tracks[e["pid"], e["tid"]].append(e)
    for track in tracks.values():
        track.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends = []
        for e in track:
            while open_ends and open_ends[-1] <= e["ts"] + EPS:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + EPS, f"{e} overlaps its neighbour"
            open_ends.append(end)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lockstep", "pipelined", "async"])
def test_trace_has_every_process_on_one_clock(mode, tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    mirror = ["--replay-mirror", "True"] if mode == "pipelined" else []  # (the GPU's path)
    # async: a ring of 1000 rows keeps the collectors within 5 chunks of the learner's reads
    # (async_window_chunks), so the learner samples several times however loaded the machine
    ring = ["--buffer-size", "2000"] if mode == "async" else []
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "1000", "--sync-mode", mode,
                     "--num-collectors", "2", "--trace", "--run-dir", run_dir, *mirror, *ring)
    assert res.returncode == 0, res.stderr[-3000:]
    data, events, names = load_trace(os.path.join(run_dir, "trace.json"))
    assert data["otherData"]["clock"] == "CLOCK_MONOTONIC"
    learner = [pid for pid, name in names.items() if name == "learner"]
    collectors = [pid for pid, name in names.items() if name.startswith("collector")]
    assert len(learner) == 1 and len(collectors) == 2 and learner[0] not in collectors
    learner = learner[0]
    assert LEARNER_SLICES <= {e["name"] for e in slices(events, learner)}
    sampling = {"learner/gather"} | ({"learner/mirror_copy"} if mirror else set())
    assert sampling <= {e["name"] for e in slices(events, learner)}
    for pid in collectors:
        assert COLLECTOR_SLICES <= {e["name"] for e in slices(events, pid)}
        chunks = sorted(e["args"]["chunk"] for e in slices(events, pid, "collector/collect_chunk"))
        assert chunks == list(range(50))  # 1000 steps / (2 envs x 10 steps), none lost
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"replay_rows", "weights_version", "chunk"} <= counters
    assert_nested_or_apart(events)

    # one clock: the learner samples chunks 0..k-1 only after every collector's slice of
    # chunk k-1 ended (the end is read before the collector tells the learner)
    ends = {(e["pid"], e["args"]["chunk"]): e["ts"] + e["dur"]
            for e in slices(events, name="collector/collect_chunk")}
    samples = slices(events, learner, "learner/replay_sample")
    assert len(samples) >= (40 if mode != "async" else 3)  # (async: at least 40 / (5 + 1))
    for s in samples:
        k = s["args"]["chunks"]
        for pid in collectors:
            assert ends[pid, k - 1] <= s["ts"] + EPS, (pid, k, ends[pid, k - 1], s["ts"])
    updates = slices(events, learner, "learner/update_critic")
    collecting = slices(events, name="collector/collect_chunk")
    overlap = [(u, c) for u in updates for c in collecting
               if c["ts"] < u["ts"] + u["dur"] and u["ts"] < c["ts"] + c["dur"]]
    if mode == "lockstep":  # the collectors wait while the learner trains
        assert not overlap, overlap[:3]


@pytest.mark.slow
def test_trace_is_bounded_and_keeps_both_ends(tmp_path, no_shm_leak):
    """--trace-events caps every track; what is kept is the run's start and its end."""
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "2000", "--trace",
                     "--trace-events", "300", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    data, events, names = load_trace(os.path.join(run_dir, "trace.json"))
    per_pid = defaultdict(int)
    for e in events:
        if e["ph"] != "M":
            per_pid[e["pid"]] += 1
    assert len(per_pid) == 2 and all(n <= 300 for n in per_pid.values()), per_pid
    assert all(n > 0 for n in data["otherData"]["records_left_out"].values())
    learner = next(pid for pid, name in names.items() if name == "learner")
    chunks = [e["args"]["chunks"] for e in slices(events, learner, "learner/replay_sample")]
    assert chunks[0] == 10 and chunks[-1] == 100  # the first training iteration and the last
    assert len(chunks) < 90  # (and not all of those between)
    # read without a browser: the table and a PNG
    png = str(tmp_path / "timeline.png")
    res = run_script(os.path.join("benchmarks", "trace_report.py"),
                     os.path.join(run_dir, "trace.json"), "--png", png, "--seconds", "0.5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "learner (" in res.stdout and "collector 0 (" in res.stdout
    assert "update_critic" in res.stdout and "env_step" in res.stdout
    assert "of the learner's busy time" in res.stdout
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_no_trace_without_the_flag(tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "400", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not {"trace.json", "profile.json"} & set(os.listdir(run_dir))
    out = str(tmp_path / "curves.png")  # (and plot.py's moving average on the same run)
    res = run_script(os.path.join("benchmarks", "plot.py"), run_dir, "--tag",
                     "charts/episodic_return", "--smooth", "3", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert os.path.getsize(out) > 1000


@pytest.mark.script(*ORIGINALS)  # (benchmarks/ alone)
def test_moving_average_and_report_arithmetic():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    from plot import moving_average
    from trace_report import busy, overlap, self_times

    assert moving_average([1, 3, 5, 7], 2) == [1, 2, 4, 6]
    assert moving_average([2.0], 5) == [2.0]
    # a parent 0-10 with children 1-3 and 3-6 (ends meet exactly), a sibling 10-12
    track = [{"name": n, "ts": a, "dur": b - a} for n, a, b in
             (("p", 0, 10), ("c", 1, 3), ("d", 3, 6), ("s", 10, 12), ("wait_for_data", 12, 20))]
    assert dict(self_times(track, 0, 20)) == {"p": 5, "c": 2, "d": 3, "s": 2,
                                              "wait_for_data": 8}
    assert dict(self_times(track, 2, 11)) == {"p": 4, "c": 1, "d": 3, "s": 1}
    assert busy(track, 0, 20) == [(0, 12)]
    assert overlap([(0, 4), (6, 10)], [(3, 7), (9, 20)]) == 1 + 1 + 1


@pytest.mark.script(*ORIGINALS)  # (common/'s alone)
def test_timeline_keeps_first_and_newest():
    tl = Timeline(10, "t", 1)
    for i in range(100):
        tl.add((f"s{i}", i, 1, None))
    kept = [r[0] for r in tl.records()]
    assert kept == [f"s{i}" for i in (0, 1, 2, 3, 4, 95, 96, 97, 98, 99)]
    assert tl.dropped == 90
    t0 = tl.now()
    t1 = tl.phase("x", t0)
    assert t1 >= t0 and tl.records()[-1][:2] == ("x", t0)
    with tl.span("y", {"a": 1}):
        pass
    assert tl.records()[-1][0] == "y" and tl.records()[-1][3] == {"a": 1}
    # tracing off: nothing is kept anywhere
    with NO_TIMELINE.span("z"):
        assert NO_TIMELINE.phase("z", NO_TIMELINE.now()) == 0


@pytest.mark.slow
@pytest.mark.script("fast_sac_multigpu.py")
def test_two_ranks_each_write_a_trace_on_the_same_clock(tmp_path, no_shm_leak):
    import subprocess
    import sys

    from conftest import ROOT

    run_dir = str(tmp_path / "run")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2",
                          os.path.join(ROOT, script_file("fast_sac_multigpu.py")), *SMALL,
                          "--total-timesteps", "1000", "--trace", "--run-dir", run_dir],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    _, rank0, names0 = load_trace(os.path.join(run_dir, "trace.json"))
    _, rank1, names1 = load_trace(os.path.join(run_dir, "trace_rank1.json"))
    assert sorted(names0.values()) == ["collector 0", "learner rank 0"]
    assert list(names1.values()) == ["learner rank 1"]  # (its node's collector is rank 0's)
    for events in (rank0, rank1):
        names = {e["name"] for e in slices(events)}
        assert {"learner/allreduce_grads", "learner/any_rank",
                "learner/barrier", "learner/update_critic"} <= names
        assert_nested_or_apart(events)
    # rank 1 samples chunk k-1 only after rank 0's collector finished it: one clock
    ends = {e["args"]["chunk"]: e["ts"] + e["dur"]
            for e in slices(rank0, name="collector/collect_chunk")}
    samples = slices(rank1, name="learner/replay_sample")
    assert len(samples) > 20
    assert all(ends[s["args"]["chunks"] - 1] <= s["ts"] + EPS for s in samples)
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["perf"]["ranks_s"] > 0


def test_killed_run_keeps_the_trace_of_its_last_checkpoint(tmp_path, no_shm_leak):
    """The trace is written at each checkpoint, so a learner killed without any chance to
    clean up still leaves one (its collectors notice and remove the shared memory)."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, assert_no_leak, shm_files

    before = shm_files()
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, script_file("fast_sac.py")),
                             *SMALL, "--total-timesteps", "100000", "--save-interval", "600",
                             "--trace", "--run-dir", run_dir], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(run_dir, "trace.json")):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(os.path.join(run_dir, "checkpoint_600.pt"))
    _, events, names = load_trace(os.path.join(run_dir, "trace.json"))
    assert "learner/checkpoint" in {e["name"] for e in slices(events)}
    assert any(name.startswith("collector") for name in names.values())
    assert_no_leak(before)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_learner_has_a_device_track(tmp_path, no_shm_leak):
    """On CUDA the update phases also appear as device slices (from CUDA events), on a track
    of their own, each starting no earlier than the host launched it."""
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "1000", "--device", "cuda",
                     "--compile", "False", "--trace", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    _, events, _ = load_trace(os.path.join(run_dir, "trace.json"))
    device = [e for e in slices(events) if e["tid"] == 1]
    host = [e for e in slices(events) if e["tid"] == 0 and e["name"] == "learner/update_critic"]
    critic = [e for e in device if e["name"] == "learner/update_critic"]
    assert len(critic) == len(host) > 0
    assert all(d["ts"] + 50 >= h["ts"] for d, h in zip(sorted(critic, key=lambda e: e["ts"]),
                                                       sorted(host, key=lambda e: e["ts"])))
    assert_nested_or_apart(events)
