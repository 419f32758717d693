"""Preemption: signal checkpoints, picking a complete checkpoint, --resume auto, bounded disk
and elastic torchrun restarts. Real runs, real signals, real processes."""

import contextlib
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
    assert_no_leak,
    checkpoints,
    run_script,
    script_file,
    script_module,
    shm_files,
    wait_for_updates,
    wait_gone,
)
from test_multigpu import ENV, SCRIPT, TORCHRUN, descendants, summary, worker_pids
from test_resume_and_faults import assert_same_params, final_params
from test_runs import children, read_summary

# (every test here runs and signals real jobs; fast_sac.py's, but for the torchrun ones)
pytestmark = [pytest.mark.slow, pytest.mark.script("fast_sac.py")]

EXACT = [*SMALL, "--env", "InvertedPendulum-v5", "--num-envs", "4", "--num-collectors", "2",
         "--save-replay"]


def start(script, *flags):
    """A run in the background (its own session, so that its process group is the run's),
    returned once it makes gradient updates."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, script_file(script)), *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    wait_for_updates(proc)
    return proc


@pytest.mark.parametrize("mode, target", [("lockstep", "learner"), ("pipelined", "group")])
def test_sigterm_checkpoint_resumes_exactly(mode, target, tmp_path, no_shm_leak):
    """SIGTERM writes a checkpoint with the replay and both collectors' snapshot at the next
    iteration; resuming it ends with the parameters of a run that was never stopped. The
    signal goes to the learner alone, or to every process of the run (its process group:
    what `timeout`, `kill -TERM -- -PGID` and a cluster's preemption send), collectors
    included."""
    full, run = str(tmp_path / "full"), str(tmp_path / "run")
    flags = [*EXACT, "--sync-mode", mode, "--total-timesteps", "12000"]
    res = run_script("fast_sac.py", *flags, "--run-dir", full)
    assert res.returncode == 0, res.stderr[-3000:]
    proc = start("fast_sac.py", *flags, "--run-dir", run)
    kids = children(proc.pid)
    assert len(kids) == 2
    if target == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert re.search(r"checkpoint_\d+\.pt written [\d.]+ s after signal 15", err), err[-2000:]
    assert all(wait_gone(k, 20) for k in kids)
    (step,) = checkpoints(run)
    assert 0 < step < 12000 and read_summary(run)["status"] == "interrupted"
    saved = torch.load(os.path.join(run, f"checkpoint_{step}.pt"), weights_only=False)
    assert saved["replay"] and len(saved["collector"]) == 2
    res = run_script("fast_sac.py", "--resume", run)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_params(final_params(full), final_params(run))


@pytest.mark.script("fast_sac_multigpu.py")
def test_sigterm_to_every_process_of_a_torchrun_job(tmp_path):
    """A cluster's preemption notice reaches the torchrun agent, every rank and every
    collector at once, and the agent forwards it to the ranks again. The ranks stop at the
    same iteration after one complete checkpoint, nothing is left running or in /dev/shm,
    and the checkpoint continues exactly: to the parameters of a run that never stopped."""
    before, run, full = shm_files(), str(tmp_path / "run"), str(tmp_path / "full")
    flags = [*SMALL, "--sync-mode", "lockstep", "--save-replay", "--num-collectors", "2"]
    job = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT, *flags]
    agent = subprocess.Popen([*job, "--total-timesteps", "10000000", "--run-dir", run],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ENV, start_new_session=True)
    wait_for_updates(agent)
    tree = [agent.pid, *descendants(agent.pid)]
    assert len(tree) >= 5  # the agent, two ranks, two collectors (and resource trackers)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    _, err = agent.communicate(timeout=120)
    assert len(re.findall(r"rank \d interrupted: checkpoint_\d+\.pt written", err)) == 2, \
        err[-3000:]
    assert_all_gone(tree, before)
    (step,) = checkpoints(run)
    assert read_summary(run)["status"] == "interrupted"
    saved = torch.load(os.path.join(run, f"checkpoint_{step}.pt"), weights_only=False)
    assert saved["replay"] and len(saved["collector"]) == 2 and len(saved["rank_rng"]) == 2
    # the resumed run and an uninterrupted one, both to 400 env steps past the checkpoint
    # (flags given on resume override the saved ones)
    end = str(step + 400)
    for cmd in ([*job[:-len(flags)], "--resume", run, "--total-timesteps", end],
                [*job, "--total-timesteps", end, "--run-dir", full]):
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=ENV)
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = summary(full), summary(run)
    assert b["status"] == "completed" and b["total_env_steps"] == int(end)
    assert a["rank_param_hashes"] == b["rank_param_hashes"]
    assert_no_leak(before)


def test_second_signal_aborts_and_keeps_previous_checkpoint(tmp_path, no_shm_leak):
    run = str(tmp_path / "run")
    proc = start("fast_sac.py", *EXACT, "--total-timesteps", "10000000", "--save-interval",
                 "400", "--run-dir", run)
    deadline = time.time() + 120
    while not checkpoints(run) and time.time() < deadline:
        time.sleep(0.1)
    kids = children(proc.pid)
    # two signals at once (of two kinds: a pending signal is not counted twice), so the
    # second arrives before the first one's checkpoint: abort now. Sent to the stopped
    # process, so that a busy machine cannot delay the second past that checkpoint.
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "stopping without a checkpoint" in err, err[-3000:]
    assert all(wait_gone(k, 20) for k in kids)
    assert not [f for f in os.listdir(run) if f.endswith(".tmp")]
    newest = checkpoints(run)[-1]
    res = run_script("fast_sac.py", "--resume", run, "--total-timesteps", str(newest + 400))
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_summary(run)["total_env_steps"] == newest + 400


def test_default_checkpoints_let_resume_auto_continue_after_sigkill(tmp_path, no_shm_leak):
    """With the default --save-interval, a learner killed outright (no handler runs: an OOM
    kill, a lost node) leaves its newest periodic checkpoint, and the same command with
    --resume auto continues from it. Its collectors see the learner gone and remove the
    shared memory themselves."""
    run = str(tmp_path / "run")
    interval = script_module("fast_sac.py").Args().save_interval
    # (many env steps per iteration and tiny updates: 100k env steps in seconds)
    cmd = [*SMALL, "--num-envs", "8", "--steps-per-iter", "50", "--buffer-size", "40000",
           "--total-timesteps", str(2 * interval), "--run-dir", run, "--resume", "auto"]
    proc = start("fast_sac.py", *cmd)
    kids = children(proc.pid)
    deadline = time.time() + 240
    while not checkpoints(run) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    assert checkpoints(run) == [interval], os.listdir(run)
    assert all(wait_gone(k, 20) for k in kids)
    assert not os.path.exists(os.path.join(run, "summary.json"))  # (it never finished)
    res = run_script("fast_sac.py", *cmd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"checkpoint_{interval}.pt at env step {interval:,}" in res.stdout, res.stdout[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["total_env_steps"] == 2 * interval


def test_cut_off_checkpoint_is_skipped_with_warning(tmp_path, no_shm_leak):
    run = str(tmp_path / "run")
    res = run_script("fast_sac.py", *EXACT, "--total-timesteps", "1200", "--save-interval",
                     "400", "--keep-checkpoints", "5", "--run-dir", run)
    assert res.returncode == 0, res.stderr[-3000:]
    assert checkpoints(run) == [400, 800]
    os.remove(os.path.join(run, "model_final.pt"))
    newest = os.path.join(run, "checkpoint_800.pt")
    with open(newest, "r+b") as f:  # cut in half, as a crash during a copy would
        f.truncate(os.path.getsize(newest) // 2)
    res = run_script("fast_sac.py", "--resume", run, "--total-timesteps", "1600")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"warning: skipping {newest}" in res.stderr
    ckpt = final_params(run)
    assert ckpt["global_step"] == 1600
    # a cut-off replay file makes its checkpoint incomplete too (the resumed run wrote a
    # new checkpoint_800.pt)
    replay = os.path.join(run, "checkpoint_1200.replay.npz")
    with open(replay, "r+b") as f:
        f.truncate(os.path.getsize(replay) // 2)
    os.remove(os.path.join(run, "model_final.pt"))
    res = run_script("fast_sac.py", "--eval-only", "--checkpoint", run)
    assert res.returncode == 0 and "replay file" in res.stderr and "checkpoint_800.pt" in res.stdout


def test_keep_checkpoints_and_resume_auto(tmp_path, no_shm_leak):
    run = str(tmp_path / "run")
    flags = [*EXACT, "--total-timesteps", "1400", "--save-interval", "200",
             "--keep-checkpoints", "2", "--resume", "auto", "--run-dir", run]
    res = run_script("fast_sac.py", *flags)  # no run dir yet: a fresh start
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted(os.listdir(run))
    assert checkpoints(run) == [1000, 1200] and "model_final.pt" in files
    assert sorted(f for f in files if f.endswith(".npz")) == [
        "checkpoint_1000.replay.npz", "checkpoint_1200.replay.npz"]
    res = run_script("fast_sac.py", *flags)  # the same command again: nothing left to do
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr[-2000:]
    res = run_script("fast_sac.py", *flags[:-4], "--resume", "auto")
    assert res.returncode == 2 and "--resume auto needs --run-dir" in res.stderr


@pytest.mark.script("fast_sac_multigpu.py")
def test_elastic_torchrun_restarts_after_a_killed_rank(tmp_path):
    """torchrun --max-restarts with --resume auto: a rank killed after the first checkpoint
    costs a restart, and the job still completes with both ranks' parameters identical."""
    before, run = shm_files(), str(tmp_path / "run")
    agent = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "--max-restarts", "2", SCRIPT,
         *SMALL, "--total-timesteps", "6000", "--save-interval", "1000", "--save-replay",
         "--resume", "auto", "--run-dir", run, "--sync-mode", "lockstep"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        deadline = time.time() + 300
        while not (os.path.isdir(run) and checkpoints(run)) and time.time() < deadline:
            assert agent.poll() is None, agent.stdout.read()[-3000:]
            time.sleep(0.1)
        killed_at = checkpoints(run)[-1]
        workers = worker_pids(agent.pid)
        os.kill(workers[1], signal.SIGKILL)
        out, _ = agent.communicate(timeout=600)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out[-4000:]
    s = summary(run)
    assert s["status"] == "completed" and s["total_env_steps"] == 6000, s
    assert s["rank_param_hashes"][0] == s["rank_param_hashes"][1]
    resumed = re.findall(r"resuming \S+checkpoint_(\d+)\.pt at env step", out)
    assert resumed and int(resumed[0]) >= killed_at, out[-3000:]
    assert_no_leak(before)
