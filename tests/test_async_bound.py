"""Async mode under a slow learner: collectors never overwrite the rows of a sample."""

import time

import numpy as np
import pytest
from conftest import script_module

from common.collectors import Collectors, async_window_chunks

fs = script_module("fast_sac.py")
pytestmark = pytest.mark.script("fast_sac.py")


def test_async_collectors_wait_for_a_slow_sampler(tmp_path, no_shm_leak):
    """A sample gathered slowly (seconds, during which a free collector would lap the
    1000-row rings several times) still reads the rows it drew; the collector waits at the
    window's edge instead."""
    args = fs.resolve_args(fs.Args(env="Pendulum-v1", device="cpu", num_envs=2,
                                   steps_per_iter=10, total_timesteps=400_000,
                                   learning_starts=100, buffer_size=2000, sync_mode="async",
                                   actor_hidden=32, batch_size=32))
    window = async_window_chunks(args)
    obs_dim, act_dim, low, high = fs.env_dims(args.env)
    collectors = Collectors.create("test", args, str(tmp_path),
                                   fs.make_actor(args, obs_dim, act_dim, low, high),
                                   obs_dim, act_dim)
    try:
        collectors.ws.publish(fs.make_actor(args, obs_dim, act_dim, low, high), 0)
        collectors.start(fs.make_env, fs.Explorer, [None])
        rb, rng, written = collectors.rb, np.random.default_rng(0), 0
        while written < 2 * rb.capacity:  # a fast learner first: the rings fill and wrap
            written = collectors.wait_for_chunk(0, written)[0] * args.steps_per_iter
        for _ in range(3):
            chunks, rows_in_flight = collectors.wait_for_chunk(0, written)
            written = chunks * args.steps_per_iter
            lo, hi = rb.valid_range(written, rows_in_flight, 1)
            env = rng.integers(0, rb.num_envs, 512)
            rows = rng.integers(lo, hi, 512) % rb.capacity
            drawn = rb.obs[env, rows].copy()
            time.sleep(1.5)  # the slow part of the gather
            assert np.array_equal(rb.obs[env, rows], drawn), "a sampled row was overwritten"
            # in 1.5 s a free collector would be far ahead: it went to the edge and waited
            assert collectors.ctrl.slowest() == chunks + window
        collectors.check()  # the collector is alive and well
    finally:
        collectors.close()
