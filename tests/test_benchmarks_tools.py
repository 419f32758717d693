"""The tools in benchmarks/ that users run on their run dirs: plot.py and curves.py."""

import json
import os

import pytest
from conftest import SMALL, run_script

# SMALL without the flags that curves.py sets itself
TINY = [a for i, a in enumerate(SMALL) if not ({SMALL[i - 1], a} & {"--eval-interval"})]


def png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_plot_tag_draws_training_returns_and_names_missing_tags(tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "1000", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    out = str(tmp_path / "train.png")
    res = run_script(os.path.join("benchmarks", "plot.py"), run_dir, "--tag",
                     "charts/episodic_return", "--out", out)
    assert res.returncode == 0 and png(out), res.stderr[-2000:]
    res = run_script(os.path.join("benchmarks", "plot.py"), run_dir, "--tag", "no/such_tag",
                     "--out", str(tmp_path / "x.png"))
    assert res.returncode != 0 and "has no scalar 'no/such_tag'" in res.stderr
    assert "charts/episodic_return" in res.stderr  # it lists the tags it has


@pytest.mark.slow
def test_curves_sweep_tabulates_reuses_and_reruns_on_new_arguments(tmp_path, no_shm_leak):
    out = str(tmp_path / "curves")
    sweep = [os.path.join("benchmarks", "curves.py"), "--scripts", "fast_sac", "--envs",
             "Pendulum-v1", "--seeds", "1", "--steps", "600", "--eval-interval", "200",
             "--out-dir", out]
    extra = " ".join(TINY[2:])  # (without --env)
    res = run_script(*sweep, f"--extra={extra}")
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(out, "curves.json")) as f:
        (row,) = json.load(f)["rows"]
    assert row["script"] == "fast_sac" and row["env_steps"] == [600]
    assert row["final_eval"][0] is not None and -2000 < row["final_eval"][0] <= 0
    assert "### Pendulum-v1" in res.stdout and png(os.path.join(out, "curves.png"))
    res = run_script(*sweep, f"--extra={extra}")  # the same command: nothing runs again
    assert res.returncode == 0 and "reusing" in res.stdout, res.stdout[-2000:]
    res = run_script(*sweep, f"--extra={extra} --seed 1")  # other arguments: it runs again
    assert res.returncode == 0 and "running it again" in res.stdout, res.stdout[-2000:]
    assert "reusing" not in res.stdout
