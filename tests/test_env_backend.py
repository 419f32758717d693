"""--env-backend envpool next to gymnasium on the same tasks (skipped without envpool)."""

import json
import os

import numpy as np
import pytest
from conftest import SMALL, run_script

import fast_sac as fs

pytest.importorskip("envpool", reason="--env-backend envpool needs: pip install envpool")


def random_episodes(envs, steps: int, seed: int):
    """Returns and lengths of the episodes finished in `steps` random steps; also checks
    that finished envs restart within the step (SAME_STEP)."""
    rng = np.random.default_rng(seed)
    space = envs.single_action_space
    obs, _ = envs.reset(seed=[seed + i for i in range(envs.num_envs)])
    ret, length, episodes = np.zeros(envs.num_envs), np.zeros(envs.num_envs), []
    for _ in range(steps):
        action = rng.uniform(space.low, space.high, (envs.num_envs, *space.shape))
        obs, reward, terminated, truncated, info = envs.step(action.astype(np.float32))
        ret, length = ret + reward, length + 1
        for i in np.flatnonzero(terminated | truncated):
            assert info["_final_obs"][i]
            # Hopper starts upright (torso height 1.25); it ended fallen or out of bounds
            assert abs(obs[i][0] - 1.25) < 0.01
            assert np.abs(info["final_obs"][i] - obs[i]).max() > 0.01
            episodes.append((ret[i], length[i]))
            ret[i], length[i] = 0.0, 0
    return np.array(episodes)


def test_envpool_matches_gymnasium_spaces_and_episode_scale():
    pool, gym_envs = fs.make_env("Hopper-v5", 4, "envpool", seed=0), fs.make_env("Hopper-v5", 4)
    try:
        for a, b in [(pool.single_observation_space, gym_envs.single_observation_space),
                     (pool.single_action_space, gym_envs.single_action_space)]:
            assert a.shape == b.shape
            assert np.array_equal(a.low, b.low) and np.array_equal(a.high, b.high)
        ours, theirs = random_episodes(pool, 1500, 0), random_episodes(gym_envs, 1500, 0)
    finally:
        pool.close(), gym_envs.close()
    assert len(ours) > 100 and len(theirs) > 100  # random Hopper falls within ~25 steps
    for column in (0, 1):  # mean return, mean length: the same scale
        assert 0.7 < ours[:, column].mean() / theirs[:, column].mean() < 1.4


@pytest.mark.parametrize("script", ["fast_sac.py", "fast_td3.py", "fast_sac_multigpu.py"])
def test_training_with_envpool_backend(script, tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = run_script(script, *SMALL, "--env", "Hopper-v5", "--env-backend", "envpool",
                     "--num-envs", "4", "--num-collectors", "2", "--total-timesteps", "1200",
                     "--save-interval", "600", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["status"] == "completed" and summary["num_updates"] > 0
    res = run_script(script, *SMALL, "--env", "Hopper-v5", "--env-backend", "envpool",
                     "--save-replay", "--run-dir", run_dir)
    assert res.returncode == 2 and "envpool's envs cannot be saved" in res.stderr
