"""benchmarks/gpu_check.sh --dry-run: every step of the one-try device check, with tiny sizes
on the CPU (gloo for torchrun), writing the same files; so the script is known to work
before a device is lent."""

import json
import os
import subprocess

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_and_writes_every_file(tmp_path, no_shm_leak):
    out = tmp_path / "out"
    res = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OUT=str(out)))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    log = (out / "gpu_check.log").read_text()
    steps = ["machine", "graph_equals_eager", "learner_speed", "learn", "two_ranks",
             "fast_sac", "multigpu", "fast_td3", "cudagraphs", "sample_time",
             "collector_scaling"]
    for name in steps:
        assert f"== {name}: exit 0 after" in log, name
    assert [log.index(f"== {name} (timeout") for name in steps] == sorted(
        log.index(f"== {name} (timeout") for name in steps)  # in the decisive order
    assert "failed: none; skipped for time: none" in log
    speed = json.loads((out / "learner_speed.json").read_text())
    assert [r["mode"] for r in speed["rows"]] == ["eager", "graph"]
    assert all(r["updates_per_s"] > 0 and r["kernels_per_update"] > 0 for r in speed["rows"])
    assert speed["rows"][1]["launches_per_update"] == 0.5  # (one graph per 2 updates)
    graph = json.loads((out / "graph_check.json").read_text())  # (the CPU stand-in: exact)
    assert graph["graph_equals_eager"] and graph["difference_over_change"]["graph"] == 0
    assert graph["difference_over_change"]["stale_batch"] > 0.1
    assert "cudagraphs failed" not in log
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs] == ["learn", "two_ranks", "fast_sac", "multigpu",
                                         "fast_td3", "cudagraphs"]
    assert all(r["status"] == "completed" and r["num_updates"] > 0 for r in runs)
    # two ranks that share a device (gloo): the same parameters at the end
    assert runs[1]["world_size"] == 2 and len(set(runs[1]["rank_param_hashes"])) == 1
    assert "parameters identical" in log
    assert runs[3]["backend"] == "gloo" and runs[3]["world_size"] == 1
    (row,) = json.loads((out / "learn_curves.json").read_text())["rows"]
    assert row["script"] == "fast_sac" and row["env_steps"] == [200]
    sample = json.loads((out / "sample_time.json").read_text())
    assert sample["host_ms"] > 0 and sample["mirror_ms"] > 0
    scaling = json.loads((out / "scaling.json").read_text())
    assert set(scaling["collector_scaling"]) == {"1", "2"}


@pytest.mark.slow
def test_gpu_check_steps_runs_only_the_steps_named(tmp_path, no_shm_leak):
    """GPU_CHECK_STEPS reruns some steps within what is left of a device lease: `machine`
    (which sizes the buffers) and the steps named run, the others are listed as not run."""
    out = tmp_path / "out"
    res = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OUT=str(out), GPU_CHECK_STEPS="fast_sac"))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    log = (out / "gpu_check.log").read_text()
    assert "== machine: exit 0 after" in log and "== fast_sac: exit 0 after" in log
    for name in ("graph_equals_eager", "learner_speed", "learn", "two_ranks", "multigpu",
                 "fast_td3", "cudagraphs", "sample_time", "collector_scaling"):
        assert f"== {name}: not in GPU_CHECK_STEPS" in log, name
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs] == ["fast_sac"] and runs[0]["num_updates"] > 0
