"""Short real runs of each script: real envs, a real collector subprocess, real shared memory."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    ROOT,
    SMALL,
    assert_all_gone,
    checkpoints,
    run_script,
    script_file,
    script_module,
    shm_files,
    wait_for_updates,
    wait_gone,
)

pytestmark = pytest.mark.script("fast_sac.py")  # (but for those parametrized by `script`)


def read_summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def check_run_dir(run_dir, mode, script):
    summary = read_summary(run_dir)
    assert summary["status"] == "completed"
    assert summary["sync_mode"] == mode and summary["env_id"] == "Pendulum-v1"
    assert summary["num_updates"] > 0 and summary["total_env_steps"] >= 1000
    assert summary["final_eval_return"] is not None and summary["wall_time_s"] > 0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir))
    ckpt = torch.load(os.path.join(run_dir, "model_final.pt"), weights_only=False)
    for key in ("actor", "critics", "critics_target", "actor_opt", "critic_opt", "args",
                "global_step", "num_updates"):
        assert key in ckpt
    assert ckpt["script"] == script_file(script).removesuffix(".py")
    if script == "fast_sac.py":
        assert "log_alpha" in ckpt and "alpha_opt" in ckpt
    assert "normalizer.mean" in ckpt["actor"] and ckpt["actor"]["normalizer.count"] > 0
    return ckpt


SCRIPTS = ["fast_sac.py", "fast_td3.py"]
# every script, where the Learner (which differs between scripts) takes part
ALL_SCRIPTS = [*SCRIPTS, "fast_sac_multigpu.py"]
# fault handling: fast_td3.py's plumbing is fast_sac.py's text (test_shared_text holds it
# so), while fast_sac_multigpu.py's training loop is its own; run as one process it needs
# no torchrun (the quick tier runs fast_sac.py's, the full suite both)
FAULT_SCRIPTS = ["fast_sac.py", pytest.param("fast_sac_multigpu.py", marks=pytest.mark.slow)]


# (fast_td3.py's data path, the replay mirror and --prefetch included, is fast_sac.py's
# text: each mode once suffices)
@pytest.mark.slow
@pytest.mark.parametrize("script, mode", [("fast_sac.py", "lockstep"),
                                          ("fast_td3.py", "pipelined")])
def test_same_seed_gives_identical_parameters(script, mode, tmp_path, no_shm_leak):
    """Also with the GPU data path in the second run: sampling from the replay mirror (on
    the CPU device here) draws the same rows as the host sampler, bit for bit, and
    gathering the next batch early (--prefetch, pipelined only) changes when it is
    gathered, never what."""
    params, fast = [], ["--replay-mirror", "True", "--prefetch", str(mode == "pipelined")]
    for name, extra in (("a", []), ("b", fast)):
        run_dir = str(tmp_path / name)
        res = run_script(script, *SMALL, "--total-timesteps", "1000", "--sync-mode", mode,
                         "--run-dir", run_dir, *extra)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "final eval" in res.stdout
        params.append(check_run_dir(run_dir, mode, script))
    a, b = params
    assert b["args"]["replay_mirror"] and not a["args"]["replay_mirror"]
    assert a["num_updates"] == b["num_updates"]
    for net in ("actor", "critics"):
        for key in a[net]:
            assert torch.equal(a[net][key], b[net][key]), f"{net}.{key} differs between runs"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["fast_sac.py"])  # (the collectors' plumbing is shared)
def test_several_collectors_are_deterministic_and_cover_every_env(script, tmp_path,
                                                                  no_shm_leak):
    """Three collectors stepping 5 envs (slices of 2, 1, 2): the same seed gives the same
    parameters, every env's ring is filled, and async mode also works with them."""
    params = []
    for name in ("a", "b"):
        run_dir = str(tmp_path / name)
        res = run_script(script, *SMALL, "--total-timesteps", "1000", "--num-envs", "5",
                         "--num-collectors", "3", "--run-dir", run_dir)
        assert res.returncode == 0, res.stderr[-3000:]
        params.append(check_run_dir(run_dir, "pipelined", script))
    a, b = params
    for net in ("actor", "critics"):
        for key in a[net]:
            assert torch.equal(a[net][key], b[net][key]), f"{net}.{key} differs between runs"
    run_dir = str(tmp_path / "async")
    res = run_script(script, *SMALL, "--total-timesteps", "2000", "--num-envs", "5",
                     "--num-collectors", "3", "--sync-mode", "async", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert check_run_dir(run_dir, "async", script)["global_step"] >= 2000


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_async_mode_trains_and_logs_update_ratio(script, tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = run_script(script, *SMALL, "--total-timesteps", "8000", "--sync-mode", "async",
                     "--save-interval", "1600", "--keep-checkpoints", "10", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    check_run_dir(run_dir, "async", script)
    saved = [int(f[11:-3]) for f in os.listdir(run_dir) if re.fullmatch(r"checkpoint_\d+\.pt", f)]
    # async collectors do not wait for the learner, so where it saves depends on timing:
    # at most once per 1600 env steps (each in its own stretch of 1600, the last one before
    # the final 8000), at least once in the seconds the 8000 steps take; all are kept
    assert saved and len({s // 1600 for s in saved}) == len(saved), sorted(saved)
    assert min(saved) >= 1600 and max(saved) < 8000, sorted(saved)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("charts/update_to_data", "charts/SPS", "charts/episodic_return",
                "losses/qf_loss", "losses/actor_loss", "perf/updates_per_sec",
                "perf/learn_time", "perf/wait_time", "perf/sync_time", "eval/episodic_return"):
        assert tag in tags, tag
    assert events.Scalars("charts/update_to_data")[-1].value > 0
    assert ("losses/alpha" in tags) == (script == "fast_sac.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_env_fails_fast_with_suggestion(script, no_shm_leak, tmp_path):
    res = run_script(script, "--env", "HalfCheeta", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2
    assert "unknown environment 'HalfCheeta'" in res.stderr and "HalfCheetah-v5" in res.stderr
    assert not (tmp_path / "r").exists()  # nothing was started or written


def start_run(tmp_path, script, *extra):
    """A long run in the background (its own session), returned once it makes gradient
    updates."""
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script_file(script)), *SMALL, "--total-timesteps",
         "10000000", "--run-dir", run_dir, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    proc.seen = wait_for_updates(proc)  # (the progress lines read so far)
    return proc, run_dir


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    out = []
    for kid in kids:
        try:
            with open(f"/proc/{kid}/cmdline") as f:
                if "spawn_main" in f.read():
                    out.append(kid)
        except FileNotFoundError:
            pass
    return out


@pytest.mark.parametrize("script", FAULT_SCRIPTS)
def test_collector_killed_learner_exits_nonzero(script, tmp_path, no_shm_leak):
    proc, run_dir = start_run(tmp_path, script, "--save-interval", "200")
    # a checkpoint first: the first updates and the first save can fall in one iteration,
    # and a collector killed while it writes its snapshot for that save leaves none
    deadline = time.time() + 60
    while not checkpoints(run_dir):
        assert time.time() < deadline and proc.poll() is None, os.listdir(run_dir)
        time.sleep(0.05)
    (collector,) = kids = children(proc.pid)
    os.kill(collector, signal.SIGKILL)
    t0 = time.time()
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 30  # seconds, not a hang (generous for a loaded machine)
    assert proc.returncode != 0, (kids, err[-3000:])
    assert "collector failed" in err, (kids, err[-3000:])
    assert read_summary(run_dir)["status"] == "failed", read_summary(run_dir)
    saved = checkpoints(run_dir)
    assert saved, os.listdir(run_dir)  # the latest checkpoint is intact: it loads
    assert not [f for f in os.listdir(run_dir) if f.endswith(".tmp")], os.listdir(run_dir)
    newest = os.path.join(run_dir, f"checkpoint_{saved[-1]}.pt")
    assert torch.load(newest, weights_only=False)["num_updates"] > 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("script", FAULT_SCRIPTS)
def test_signal_saves_checkpoint_and_cleans_up(script, sig, tmp_path, no_shm_leak):
    proc, run_dir = start_run(tmp_path, script)
    (collector,) = children(proc.pid)
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert read_summary(run_dir)["status"] == "interrupted"
    ckpts = [f for f in os.listdir(run_dir) if f.startswith("checkpoint_")]
    assert len(ckpts) == 1 and ckpts[0].endswith(".pt")
    state = torch.load(os.path.join(run_dir, ckpts[0]), weights_only=False)
    assert state["num_updates"] > 0
    assert wait_gone(collector, 20)


def test_signal_to_the_group_while_collectors_import(tmp_path, no_shm_leak):
    """SIGTERM to every process of a run the moment its collectors exist, while they still
    import (seconds, before they can ignore it: a preemption early in a run, or `timeout`
    on a slow start) stops it as an interrupt with a checkpoint, not as a failed collector."""
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script_file("fast_sac.py")), *SMALL,
         "--num-collectors", "2", "--total-timesteps", "4000", "--run-dir", run_dir], cwd=ROOT,
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    t0 = time.time()
    while len(kids := children(proc.pid)) < 2 and time.time() - t0 < 120:
        time.sleep(0.01)
    assert len(kids) == 2, proc.communicate()[1][-3000:]
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "failed" not in err and "written" in err, err[-3000:]
    assert read_summary(run_dir)["status"] == "interrupted"
    assert all(wait_gone(k, 20) for k in kids)


def test_signal_after_the_output_pipe_closed(tmp_path, no_shm_leak):
    """A run whose reader is gone (a killed `| tee`, a driver script stopped first) and
    then gets SIGINT: printing 'interrupted' fails, and the run still stops its collectors
    and exits, instead of waiting for them at interpreter exit forever."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script_file("fast_sac.py")), *SMALL,
         "--log-interval", "5", "--total-timesteps", "1000000", "--run-dir",
         str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_for_updates(proc)  # (then 5 s until the next line: the signal comes first)
        kids = children(proc.pid)
        proc.stdout.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode != 0
        assert all(wait_gone(k, 20) for k in kids)
    finally:
        if proc.poll() is None:  # (the hang this test is about; its collectors follow)
            proc.kill()


@pytest.mark.parametrize("script, collectors, target", [
    ("fast_sac.py", 1, "learner"), ("fast_sac.py", 1, "group"),
    pytest.param("fast_sac_multigpu.py", 1, "learner", marks=pytest.mark.slow),
    pytest.param("fast_sac.py", 2, "learner", marks=pytest.mark.slow)])
def test_learner_killed_collector_exits_and_removes_memory(script, collectors, target,
                                                            tmp_path):
    """SIGKILL to the learner alone, or to its whole process group (what torchrun sends a
    rank that outlived its SIGTERM by 30 s; it kills the learner's resource tracker too)."""
    before = shm_files()
    proc, _ = start_run(tmp_path, script, "--num-envs", "2", "--num-collectors",
                        str(collectors))
    kids = children(proc.pid)
    assert len(kids) == collectors
    assert shm_files() - before  # the run's segments exist (owned by its living learner)
    if target == "group":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
    proc.wait()
    assert_all_gone(kids, before)  # no collector outlives its learner


@pytest.mark.slow
@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_fast_path_flags_train_on_cpu(script, tmp_path, no_shm_leak):
    """The GPU fast path's code (compiled losses, bf16 autocast, prefetching) also runs on
    the CPU when asked for, in every script."""
    run_dir = str(tmp_path / "run")
    res = run_script(script, *SMALL, "--total-timesteps", "1000", "--compile", "True",
                     "--amp", "True", "--prefetch", "True", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = check_run_dir(run_dir, "pipelined", script)
    assert ckpt["args"]["compile"] and ckpt["args"]["amp"] and ckpt["args"]["prefetch"]


@pytest.mark.slow
def test_compile_failure_stops_before_anything_starts(tmp_path, no_shm_leak):
    """--compile fails in its warm-up update, before the collectors, the shared memory or
    the run dir exist, naming the way out. The failure is real: inductor is given no
    working C++ compiler (and an empty cache, so that it has to compile)."""
    run_dir = tmp_path / "run"
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "1000", "--compile", "True",
                     "--run-dir", str(run_dir), timeout=120,
                     env={"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ic")})
    assert res.returncode == 2, res.stderr[-3000:]
    assert "--compile failed in the warm-up update" in res.stderr
    assert "run with --compile False" in res.stderr and "Traceback" not in res.stderr
    assert not run_dir.exists()


def test_default_fast_path_that_fails_to_compile_goes_on_eager(tmp_path, no_shm_leak):
    """Where --compile and --amp are on by default (a long run on a CPU with native bf16), a
    compile that fails while the user did not ask for it costs one line of warning, and the
    same run goes on eager. The failure is real: inductor gets no working C++ compiler and
    an empty cache."""
    fs = script_module("fast_sac.py")
    if not fs.resolve_args(fs.Args(env="Pendulum", device="cpu")).compile:
        pytest.skip("this CPU does not multiply bf16 natively: the fast path is off by default")
    flags = [a for a in SMALL if a not in ("--compile", "--amp", "False")]
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script_file("fast_sac.py")), *flags,
         "--total-timesteps", "10000000", "--run-dir", str(tmp_path / "run")], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", CXX="/bin/false",
                 TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ic")))
    wait_for_updates(proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("warning: --compile")]
    assert len(warnings) == 1 and "going on without --compile and --amp" in warnings[0]
    (name,) = [f for f in os.listdir(tmp_path / "run") if f.startswith("checkpoint_")]
    saved = torch.load(tmp_path / "run" / name, weights_only=False)["args"]
    assert not saved["compile"] and not saved["amp"] and saved["total_timesteps"] == 10000000
