import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from common.weights import WeightSync


def make_module(fill=0.0):
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    m.register_buffer("count", torch.zeros((), dtype=torch.float64))
    with torch.no_grad():
        for t in m.state_dict().values():
            t.fill_(fill)
    return m


def test_roundtrip_and_versions(no_shm_leak):
    src = make_module()
    ws = WeightSync.create(src)
    try:
        assert ws.read() is None  # nothing published yet
        torch.manual_seed(0)
        src = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
        src.register_buffer("count", torch.tensor(12345.0, dtype=torch.float64))
        ws.publish(src, 0)
        dst = make_module(7.0)
        version, flat = ws.read(0)
        ws.load_into(dst, flat)
        assert version == 0
        for a, b in zip(src.state_dict().values(), dst.state_dict().values()):
            assert torch.equal(a, b)
        assert ws.read(1) is None  # asked for a version not yet written
        ws.publish(make_module(1.0), 1)
        ws.publish(make_module(2.0), 2)
        assert ws.read(1)[1][0] == 1.0 and ws.read()[0] == 2
        with pytest.raises(LookupError):
            ws.read(0)  # overwritten by version 2
    finally:
        ws.close()
        ws.unlink()


def _writer(spec, versions):
    ws = WeightSync.attach(spec)
    m = make_module()
    for v in range(1, versions + 1):
        with torch.no_grad():
            for t in m.state_dict().values():
                t.fill_(float(v))
        ws.publish(m, v)
    ws.close()


def _writer_until(spec, stop, deadline_s):
    """Publish versions 1, 2, ... until `stop` is set (or the deadline passes)."""
    ws = WeightSync.attach(spec)
    m, v, end = make_module(), 0, time.monotonic() + deadline_s
    while not stop.is_set() and time.monotonic() < end:
        v += 1
        with torch.no_grad():
            for t in m.state_dict().values():
                t.fill_(float(v))
        ws.publish(m, v)
    ws.close()


def test_no_torn_read_under_concurrent_writer(no_shm_leak):
    """The writer runs until this reader has seen many versions, so the reads overlap the
    writes however the two processes are scheduled."""
    ctx = mp.get_context("spawn")
    ws = WeightSync.create(make_module())
    ws.publish(make_module(0.0), 0)
    stop = ctx.Event()
    writer = ctx.Process(target=_writer_until, args=(ws.spec, stop, 120))
    writer.start()
    reads, distinct, end = 0, set(), time.monotonic() + 120
    try:
        while (len(distinct) < 100 or reads < 1000) and time.monotonic() < end:
            version, flat = ws.read()
            # every value of a consistent state equals its version
            assert np.all(flat == version), f"torn read at version {version}"
            reads += 1
            distinct.add(version)
        assert len(distinct) >= 100, "the writer never published while we read"
    finally:
        stop.set()
        writer.join(30)
        if writer.is_alive():
            writer.kill()
            writer.join()
        ws.close()
        ws.unlink()
    assert writer.exitcode == 0
