"""Concurrency stress: shared memory under real concurrent processes.

The processes here share two cores with whatever else runs, so no test relies on how fast
one of them gets: whoever must overlap with whom waits for the other, and every wait ends
at a deadline (a failed assertion, not a hang).
"""

import itertools
import multiprocessing as mp
import time

import numpy as np
import torch
from test_weights import make_module

from common.replay import ReplayBuffer
from common.weights import WeightSync

READERS, MIN_READS, MIN_VERSIONS = 3, 100_000, 100
ROWS, MIN_CHECKS = 200_000, 1000
DEADLINE_S = 120  # each test takes ~15 s on a loaded 2-core machine; past this it is broken


def _publishing_writer(spec, progress, done, deadline_s):
    """Publish versions 1, 2, ... until every reader has reported enough reads and distinct
    versions in `progress` ([reads, distinct] per reader), then set `done`."""
    ws = WeightSync.attach(spec)
    m, v = make_module(), 0
    per_reader = -(-MIN_READS // READERS)
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            v += 1
            with torch.no_grad():
                for t in m.state_dict().values():
                    t.fill_(float(v))
            ws.publish(m, v)
            reads, distinct = progress[0::2], progress[1::2]
            if min(reads) >= per_reader and min(distinct) >= MIN_VERSIONS:
                break
    finally:
        done.set()  # also on a timeout or an error, so readers stop
        ws.close()


def _reader(spec, index, progress, done, out, deadline_s):
    """Read from once the writer has published until it is done; report
    (torn reads, reads, distinct versions seen)."""
    ws = WeightSync.attach(spec)
    end = time.monotonic() + deadline_s
    while ws.read()[0] == 0 and not done.is_set() and time.monotonic() < end:
        time.sleep(0.001)  # the writer has not published yet
    bad = seen = 0
    versions = set()
    while not done.is_set() and time.monotonic() < end:
        for _ in range(1000):
            version, flat = ws.read()
            bad += int(not np.all(flat == version))  # a torn read mixes two versions
            versions.add(version)
        seen += 1000
        progress[2 * index], progress[2 * index + 1] = seen, len(versions)
    ws.close()
    out.put((bad, seen, len(versions)))


def test_weight_sync_many_readers_no_torn_read(no_shm_leak):
    ctx = mp.get_context("spawn")
    ws = WeightSync.create(make_module())
    ws.publish(make_module(0.0), 0)
    out, done = ctx.Queue(), ctx.Event()
    progress = ctx.Array("q", 2 * READERS, lock=False)  # [reads, distinct versions] per reader
    writer = ctx.Process(target=_publishing_writer, args=(ws.spec, progress, done, DEADLINE_S))
    readers = [ctx.Process(target=_reader, args=(ws.spec, i, progress, done, out, DEADLINE_S))
               for i in range(READERS)]
    try:
        writer.start()
        for p in readers:
            p.start()
        results = [out.get(timeout=DEADLINE_S + 60) for _ in readers]
        writer.join(60)
        for p in readers:
            p.join(60)
        assert writer.exitcode == 0 and all(p.exitcode == 0 for p in readers)
        assert sum(r[0] for r in results) == 0, "torn reads"
        assert sum(r[1] for r in results) >= MIN_READS, results
        # every reader kept reading while the writer published: many versions each
        assert all(r[2] >= MIN_VERSIONS for r in results), results
    finally:
        for p in [*readers, writer]:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(10)
        ws.close()
        ws.unlink()


def _replay_writer(spec, stop, deadline_s):
    """Write rows 0, 1, ... (publishing every 8) until `stop` is set."""
    rb = ReplayBuffer.attach(spec)
    n, d = rb.num_envs, rb.obs.shape[-1]
    end = time.monotonic() + deadline_s
    for t in itertools.count():
        if t % 8 == 0 and (stop.is_set() or time.monotonic() > end):
            break
        # every field of row t encodes t, so a mixed row is detectable
        obs = np.full((n, d), t, np.float32)
        rb.write(slice(None), t, obs, np.full((n, 1), t, np.float32), np.full(n, t, np.float32),
                 obs + 1, np.zeros(n), np.zeros(n))
        if t % 8 == 7:
            rb.commit(slice(None), t + 1)
    rb.close()


def test_replay_concurrent_write_and_sample_rows_consistent(no_shm_leak):
    rb = ReplayBuffer.create(num_envs=4, capacity=256, obs_dim=5, act_dim=1)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=_replay_writer, args=(rb.spec, stop, DEADLINE_S))
    rng = np.random.default_rng(0)
    end = time.monotonic() + DEADLINE_S
    try:
        proc.start()
        checked = written = 0
        # the writer runs until we stop it, so every check below overlaps with its writes
        while (checked < MIN_CHECKS or written < ROWS) and proc.is_alive():
            assert time.monotonic() < end, f"{checked} checks, {written} rows by the deadline"
            written = int(rb.written.min())
            if written < 16:
                time.sleep(0.001)
                continue
            # the writer publishes every 8 rows; rows it may write while we sample are
            # excluded by the window. If it wrote more than that meanwhile (we were
            # descheduled), the guarantee does not apply and the sample is skipped.
            batch = rb.sample(rng, 64, 1, 0.99, written, window=64)
            if int(rb.written.min()) + 8 - written > 64:
                continue
            t = batch["obs"][:, 0]
            assert (batch["obs"] == t[:, None]).all()
            assert (batch["actions"][:, 0] == t).all()
            assert (batch["next_obs"] == t[:, None] + 1).all()
            assert (batch["rewards"] == t).all()
            checked += 1
        assert proc.is_alive(), f"writer ended early (exit code {proc.exitcode})"
        stop.set()
        proc.join(60)
        assert proc.exitcode == 0 and checked >= MIN_CHECKS
    finally:
        stop.set()
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        rb.close()
        rb.unlink()
