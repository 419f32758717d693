"""The tools in benchmarks/ that users run on their run dirs: plot.py and curves.py."""

import json
import os

import pytest
from conftest import SMALL, run_script, script_file

# SMALL without the flags that curves.py sets itself
TINY = [a for i, a in enumerate(SMALL) if not ({SMALL[i - 1], a} & {"--eval-interval"})]


def png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.script("fast_sac.py")
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
@pytest.mark.script("fast_sac.py")
def test_curves_sweep_tabulates_reuses_and_reruns_on_new_arguments(tmp_path, no_shm_leak):
    out, name = str(tmp_path / "curves"), script_file("fast_sac.py").removesuffix(".py")
    sweep = [os.path.join("benchmarks", "curves.py"), "--scripts", name, "--envs",
             "Pendulum-v1", "--seeds", "1", "--steps", "600", "--eval-interval", "200",
             "--out-dir", out]
    extra = " ".join(TINY[2:])  # (without --env)
    res = run_script(*sweep, f"--extra={extra}")
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(out, "curves.json")) as f:
        (row,) = json.load(f)["rows"]
    assert row["script"] == name and row["env_steps"] == [600]
    assert row["final_eval"][0] is not None and -2000 < row["final_eval"][0] <= 0
    # the mean of the last three evals; on Pendulum (returns <= 0) no share of the best
    assert row["last_three"][0] <= row["best_eval"][0] and "| last three evals |" in res.stdout
    assert row["of_best"] == [None]
    assert "### Pendulum-v1" in res.stdout and png(os.path.join(out, "curves.png"))
    # the table says where, when and how: the CPU model, the commit, each run's command
    assert "Made on " in res.stdout and ", commit " in res.stdout
    assert f"python {name}.py --env Pendulum-v1 --seed 1 --run-dir" in res.stdout
    res = run_script(*sweep, f"--extra={extra}")  # the same command: nothing runs again
    assert res.returncode == 0 and "reusing" in res.stdout, res.stdout[-2000:]
    res = run_script(*sweep, f"--extra={extra} --seed 1")  # other arguments: it runs again
    assert res.returncode == 0 and "running it again" in res.stdout, res.stdout[-2000:]
    assert "reusing" not in res.stdout


def test_collectors_without_a_learner_cross_the_async_window(tmp_path, no_shm_leak):
    """throughput.py times async collectors with no learner: one collector of 4 envs collects
    150 chunks of 8 steps into rings of 2048 rows, whose async window is 12 chunks. The
    benchmark moves the learner's read position along, so the collector never waits at the
    window's edge for a learner that is not there (it did, and the benchmark hung)."""
    out = tmp_path / "scaling.json"
    res = run_script(os.path.join("benchmarks", "throughput.py"), "--env", "Pendulum-v1",
                     "--scaling-only", "--repeats", "1", "--collectors", "1", "--out", str(out),
                     timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        assert json.load(f)["medians"]["collectors_1/steps_per_s"] > 0


@pytest.mark.slow
def test_throughput_quick_path_finishes_with_every_figure(tmp_path, no_shm_leak):
    """The whole --quick path (its collector-alone step crosses the async window too), with
    training runs of 3,000 env steps rather than 8,000 (each run's start and end, about 8 s,
    is most of its time either way), every learner eager."""
    out = tmp_path / "throughput.json"
    res = run_script(os.path.join("benchmarks", "throughput.py"), "--env", "Pendulum-v1",
                     "--quick", "--run-steps", "3000", "--compile", "False", "--out", str(out),
                     timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        result = json.load(f)
    assert result["compile_and_amp"] is False
    for key in ("collector_efficiency/default", "learner_efficiency/default", "overlap",
                "collector_gap/plumbing"):
        assert result[key] > 0, key


def test_learner_speed_reports_the_limit_and_a_profile(tmp_path):
    """learner_speed.py's rows carry the FLOPs of an update (torch's flop counter), the
    matmul peak measured in the same run for the row's dtype, and the fraction of the limit
    they give; --profile writes torch.profiler's trace."""
    out, prof = tmp_path / "speed.json", tmp_path / "prof"
    res = run_script(os.path.join("benchmarks", "learner_speed.py"), "--device", "cpu",
                     "--env", "Pendulum-v1", "--batch-sizes", "32", "--hidden", "32",
                     "--modes", "eager", "amp", "--updates-per-iter", "2", "--iterations", "2",
                     "--repeats", "1", "--warmup", "1", "--threads", "1", "--profile",
                     str(prof), "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [(r["mode"], r["dtype"]) for r in rows] == [("eager", "float32"),
                                                       ("amp", "bfloat16")]
    for r in rows:
        assert r["gflop_per_update"] > 0 and max(r["matmul_gflops"].values()) > 0
        limit = max(r["matmul_gflops"].values()) / r["gflop_per_update"]
        assert r["limit_updates_per_s"] == pytest.approx(limit, rel=0.01)
        assert r["of_limit"] == pytest.approx(r["updates_per_s"] / limit, rel=0.01)
    assert rows[0]["gflop_per_update"] == rows[1]["gflop_per_update"]  # the same arithmetic
    assert sorted(os.listdir(prof)) == ["amp_t1_h32_b32.json", "eager_t1_h32_b32.json"]
    assert "ms of operator self time per update" in res.stdout
