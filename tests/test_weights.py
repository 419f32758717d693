import multiprocessing as mp

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


def test_no_torn_read_under_concurrent_writer(no_shm_leak):
    ws = WeightSync.create(make_module())
    ws.publish(make_module(0.0), 0)
    writer = mp.get_context("spawn").Process(target=_writer, args=(ws.spec, 20_000))
    writer.start()
    reads, distinct = 0, set()
    try:
        while writer.is_alive() or reads < 1000:
            version, flat = ws.read()
            # every value of a consistent state equals its version
            assert np.all(flat == version), f"torn read at version {version}"
            reads += 1
            distinct.add(version)
        writer.join()
        assert writer.exitcode == 0
        assert len(distinct) > 10  # the reads really overlapped with the writes
    finally:
        writer.join(10)
        ws.close()
        ws.unlink()
