"""Proof of learning: a broken update rule fails this."""

import json
import os

import pytest
from conftest import run_script


@pytest.mark.parametrize("script", ["fast_sac.py", "fast_td3.py"])
def test_pendulum_learns(script, tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    # a higher update-to-data ratio than the CPU recipe's: 6000 env steps must suffice
    res = run_script(script, "--env", "Pendulum-v1", "--total-timesteps", "6000",
                     "--learning-starts", "1000", "--num-envs", "4", "--sync-mode", "lockstep",
                     "--updates-per-iter", "16",
                     "--eval-episodes", "10", "--eval-interval", "0", "--seed", "1",
                     "--run-dir", run_dir, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    # random policy: about -1200; a learned swing-up: above -200
    assert summary["final_eval_return"] > -300, summary
