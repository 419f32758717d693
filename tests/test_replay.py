import os

import numpy as np
import pytest
import torch

from common.replay import Mirror, ReplayBuffer


@pytest.fixture
def rb(no_shm_leak):
    buf = ReplayBuffer.create(num_envs=2, capacity=8, obs_dim=3, act_dim=1)
    yield buf
    buf.close()
    buf.unlink()


def fill(rb, steps, dones=(), terminated=(), start=0):
    """Row t of env e: obs = 100*e + t, reward = t + 1; next_obs = obs + 0.5."""
    for t in range(start, start + steps):
        obs = np.array([[100 * e + t] * 3 for e in range(rb.num_envs)], np.float32)
        rb.write(slice(None), t, obs, np.zeros((2, 1)), np.full(2, t + 1.0), obs + 0.5,
                 np.full(2, t in terminated), np.full(2, t in dones or t in terminated))
    rb.commit(slice(None), start + steps)


def test_ring_wraps_and_keeps_newest(rb):
    fill(rb, 11)  # capacity 8: steps 3..10 remain
    assert sorted(rb.obs[0, :, 0].tolist()) == list(range(3, 11))
    assert rb.rows(9, 11)[:, 0].tolist() == [9, 10, 109, 110]
    assert int(rb.written[0]) == 11


def test_valid_range_excludes_write_window_and_incomplete_rows(rb):
    assert rb.valid_range(written=5, window=0, n_step=1) == (0, 5)
    assert rb.valid_range(written=5, window=0, n_step=3) == (0, 3)  # needs 2 successors
    # full ring: the next 2 rows to be written overwrite the 2 oldest (steps 3 and 4)
    assert rb.valid_range(written=11, window=2, n_step=1) == (5, 11)
    fill(rb, 11)
    batch = rb.sample(np.random.default_rng(0), 4000, 1, 0.99, written=11, window=2)
    starts = batch["obs"][:, 0] % 100
    assert starts.min() == 5 and starts.max() == 10


def test_rows_in_flight_are_never_sampled(rb):
    fill(rb, 6)
    fill(rb, 2, start=6)  # written but, as far as this reader knows, not yet published
    batch = rb.sample(np.random.default_rng(0), 4000, 1, 0.99, written=6, window=0)
    assert (batch["obs"][:, 0] % 100).max() == 5


def test_nstep_sum_matches_hand_computed(rb):
    fill(rb, 6)
    batch = rb.sample(np.random.default_rng(1), 500, 3, 0.5, written=6)
    t = batch["obs"][:, 0] % 100
    # r_t = t+1: R = (t+1) + 0.5 (t+2) + 0.25 (t+3); bootstrap 0.5**3 from row t+2
    np.testing.assert_allclose(batch["rewards"], (t + 1) + 0.5 * (t + 2) + 0.25 * (t + 3))
    np.testing.assert_allclose(batch["discounts"], 0.125)
    np.testing.assert_allclose(batch["next_obs"][:, 0], batch["obs"][:, 0] + 2.5)


def test_nstep_stops_at_truncation_and_bootstraps(rb):
    fill(rb, 6, dones=(1,))  # episode truncated after step 1
    batch = rb.sample(np.random.default_rng(2), 500, 3, 0.5, written=6)
    t = batch["obs"][:, 0] % 100
    at0 = t == 0
    assert at0.any()
    np.testing.assert_allclose(batch["rewards"][at0], 1 + 0.5 * 2)  # steps 0 and 1 only
    np.testing.assert_allclose(batch["discounts"][at0], 0.25)  # truncation still bootstraps
    np.testing.assert_allclose(batch["next_obs"][at0, 0], batch["obs"][at0, 0] + 1.5)


def test_nstep_stops_at_termination_without_bootstrap(rb):
    fill(rb, 6, terminated=(2,))
    batch = rb.sample(np.random.default_rng(3), 500, 3, 0.5, written=6)
    t = batch["obs"][:, 0] % 100
    for start, reward in ((0, 1 + 0.5 * 2 + 0.25 * 3), (1, 2 + 0.5 * 3), (2, 3)):
        sel = t == start
        assert sel.any()
        np.testing.assert_allclose(batch["rewards"][sel], reward)
        np.testing.assert_allclose(batch["discounts"][sel], 0.0)
    after = t == 3  # the next episode starts fresh and bootstraps normally
    np.testing.assert_allclose(batch["discounts"][after], 0.125)


def test_attach_sees_writes_and_unlink_removes(no_shm_leak):
    rb = ReplayBuffer.create(num_envs=1, capacity=4, obs_dim=2, act_dim=1)
    other = ReplayBuffer.attach(rb.spec)
    other.write(slice(None), 0, np.ones((1, 2)), np.ones((1, 1)), np.ones(1), np.ones((1, 2)),
                np.zeros(1), np.zeros(1))
    other.commit(slice(None), 1)
    assert rb.obs[0, 0].tolist() == [1.0, 1.0] and int(rb.written[0]) == 1
    other.close()
    rb.close()
    rb.unlink()
    with pytest.raises(FileNotFoundError):
        ReplayBuffer.attach(rb.spec)


def test_memory_is_exactly_the_rows(no_shm_leak):
    """obs, next_obs, actions and three float32 scalars per transition, and a 64-byte line
    each for the written counters and the amended counter (each field is 64-byte aligned;
    these sizes need no padding); the segment in /dev/shm has exactly that size."""
    cap, obs, act = 10_000, 17, 6
    nbytes = ReplayBuffer.nbytes(4, cap // 4, obs, act)
    assert nbytes == cap * (2 * obs + act + 3) * 4 + 2 * 64
    rb = ReplayBuffer.create(4, cap // 4, obs, act)
    try:
        assert os.path.getsize(f"/dev/shm/{rb.spec['name']}") == nbytes
    finally:
        rb.close()
        rb.unlink()


def test_device_mirror_batches_equal_host_batches_bit_for_bit(no_shm_leak):
    """The mirror (here on the CPU device) against the host sampler with the same draws,
    chunk by chunk through several ring wraps, random episode ends and terminations, and
    an in-flight write window whose rows hold NaN (neither may ever read them)."""
    E, C, S, window, n = 3, 24, 4, 4, 3
    rb = ReplayBuffer.create(num_envs=E, capacity=C, obs_dim=5, act_dim=2)
    data = np.random.default_rng(0)
    mirror = Mirror(rb, np.random.default_rng(7), torch.device("cpu"), 257, n, 0.97)
    host = np.random.default_rng(7)

    def write(step, value=None):
        def f(*shape):
            return np.full(shape, value) if value is not None else data.normal(size=shape)
        rb.write(slice(None), step, f(E, 5), f(E, 2), f(E), f(E, 5),
                 data.random(E) < 0.1, data.random(E) < 0.3)

    try:
        for chunk in range(1, 4 * C // S):
            for step in range((chunk - 1) * S, chunk * S):
                write(step)
            written = chunk * S
            rb.commit(slice(None), written)
            for step in range(written, written + window):  # the collectors' next chunk
                write(step, np.nan)
            if written < n:
                continue
            for _ in range(2):  # (the second sample copies nothing new)
                expected = rb.sample(host, 257, n, 0.97, written, window)
                got = mirror(written, window, 0)
                for key, value in expected.items():
                    assert not np.isnan(value).any(), key
                    assert torch.equal(got[key], torch.from_numpy(value)), (chunk, key)
        assert mirror.upto == written and written > 3 * C  # wrapped three times
    finally:
        rb.close()
        rb.unlink()


def test_device_mirror_refills_after_resume(no_shm_leak):
    """A new mirror over a full buffer (as after a resume, with a floor) copies every row
    that may be sampled in its first update."""
    rb = ReplayBuffer.create(num_envs=2, capacity=8, obs_dim=3, act_dim=1)
    try:
        fill(rb, 13)
        mirror = Mirror(rb, np.random.default_rng(0), torch.device("cpu"), 64, 1, 0.99)
        batch = mirror(13, window=0, floor=7)
        assert sorted(set((batch["obs"][:, 0] % 100).tolist())) == list(range(7, 13))
        rows = np.arange(7, 13) % 8
        for key in ("obs", "next_obs", "rewards", "dones"):
            host = torch.from_numpy(getattr(rb, key)[:, rows])
            assert torch.equal(mirror.fields[key][:, rows], host)
        assert not mirror.fields["obs"][:, [5, 6]].any()  # below the floor: not copied
    finally:
        rb.close()
        rb.unlink()
