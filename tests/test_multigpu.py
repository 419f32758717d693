"""fast_sac_multigpu.py under torchrun on CPU (gloo): the same code path as NCCL on GPUs."""

import json
import os
import re
import select
import signal
import socket
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
    run_script,
    script_file,
    shm_files,
)

pytestmark = pytest.mark.script("fast_sac_multigpu.py")

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SCRIPT = os.path.join(ROOT, script_file("fast_sac_multigpu.py"))
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lockstep", "pipelined"])
def test_two_ranks_train_with_identical_parameters(mode, tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT, *SMALL,
                          "--total-timesteps", "1000", "--sync-mode", mode, "--run-dir", run_dir,
                          "--prefetch", "True", "--replay-mirror", "True"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-4000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["num_updates"] > 0
    assert s["world_size"] == 2 and s["nodes"] == 1 and s["backend"] == "gloo"
    hashes = s["rank_param_hashes"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]


def test_allreduced_gradient_equals_single_process_gradient():
    res = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node", "2",
                          os.path.join(ROOT, "tests", "dist_grad_check.py"),
                          script_file("fast_sac_multigpu.py").removesuffix(".py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("gradients match") == 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(run_dir, *flags, base=SMALL):
    """Two torchrun agents on this machine as two nodes of one rank each, launched as
    docs/slurm_multinode.sbatch launches them (c10d rendezvous, one job id), each node with
    its own collector; (return codes, stdouts, stderrs)."""
    port, job = free_port(), f"test{os.getpid()}{time.time_ns()}"
    procs = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job, "--shutdown-timeout", "110",
         SCRIPT, *base, "--sync-mode", "pipelined", "--run-dir", run_dir,
         "--replay-mirror", "True", *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for _ in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    return [p.returncode for p in procs], *zip(*outs)


@pytest.mark.slow
def test_two_nodes_each_with_own_collector(tmp_path, no_shm_leak):
    """--total-timesteps counts both nodes' env steps: each node collects half, and a
    --resume auto past the halfway point continues to the new total. On Reacher, which
    VALUE_RANGES lacks, so the critics' support follows the returns that both nodes saw,
    the same on both ranks (their hashes include it)."""
    run_dir = str(tmp_path / "run")
    flags = ["--save-interval", "400", "--resume", "auto"]
    reacher = [("Reacher-v5" if a == "Pendulum-v1" else a) for a in SMALL]
    codes, _, errs = two_nodes(run_dir, "--total-timesteps", "1200", *flags, base=reacher)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["nodes"] == 2
    assert s["rank_param_hashes"][0] == s["rank_param_hashes"][1]
    # 1200 env steps of 2 nodes x 2 envs x 10 steps per iteration: 30 iterations
    assert s["total_env_steps"] == 1200 and s["iterations"] == 30, s
    codes, outs, errs = two_nodes(run_dir, "--total-timesteps", "2000", *flags, base=reacher)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    out = "".join(outs)  # (rank 0 prints; the rendezvous decides which agent holds it)
    assert "resuming" in out and "at env step 1,200" in out, out[-2000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["total_env_steps"] == 2000, s
    assert s["rank_param_hashes"][0] == s["rank_param_hashes"][1]
    final = torch.load(os.path.join(run_dir, "model_final.pt"), weights_only=False)
    support, vr = final["critics"]["support"], final["value_range"]
    # random actions on Reacher earn about -0.8 a step: running returns reach -30 and lower
    assert vr["lo"] < -10 and vr["hi"] == 0.0
    assert (support[0].item(), support[-1].item()) == pytest.approx(
        (vr["lo"] * 1.25, -vr["lo"] / 2), rel=1e-5)


def test_single_process_without_torchrun_behaves_like_fast_sac(tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac_multigpu.py", *SMALL, "--total-timesteps", "600",
                     "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["world_size"] == 1 and s["num_updates"] > 0


def test_world_size_without_torchrun_is_a_clear_error(tmp_path, no_shm_leak):
    res = subprocess.run([sys.executable, SCRIPT, *SMALL, "--run-dir", str(tmp_path / "r")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(ENV, WORLD_SIZE="4"))
    assert res.returncode == 2 and "torchrun --nproc_per_node" in res.stderr
    assert not (tmp_path / "r").exists()


def test_share_device_with_nccl_is_refused_with_the_reason(tmp_path, no_shm_leak):
    """--share-device (several ranks on one GPU, for testing on a one-GPU machine) needs gloo:
    NCCL refuses two ranks on one device. Refused before anything starts."""
    res = run_script("fast_sac_multigpu.py", *SMALL, "--share-device", "--dist-backend",
                     "nccl", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "NCCL refuses" in res.stderr and "use --dist-backend gloo" in res.stderr
    assert not (tmp_path / "r").exists()


def worker_pids(agent_pid):
    """The ranks that the torchrun agent `agent_pid` started (its child processes, which
    carry LOCAL_RANK in their environment): never another job's processes."""
    out = {}
    for pid in descendants(agent_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        if os.path.basename(SCRIPT).encode() in cmd and b"LOCAL_RANK" in env:
            out[int(env[b"LOCAL_RANK"])] = pid
    return out


def descendants(root):
    parent = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


@pytest.mark.slow
def test_killed_rank_stops_every_process(tmp_path):
    before = shm_files()
    run_dir = str(tmp_path / "run")
    agent = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT, *SMALL,
         "--total-timesteps", "10000000", "--run-dir", run_dir, "--dist-timeout", "30"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 300
    while time.time() < deadline:  # wait for gradient updates
        ready, _, _ = select.select([agent.stdout], [], [], 1.0)
        line = agent.stdout.readline() if ready else ""
        m = re.search(r"updates\s+([\d,]+)", line)
        if m and int(m.group(1).replace(",", "")) > 0:
            break
        assert agent.poll() is None, agent.stderr.read()[-3000:]
    workers = worker_pids(agent.pid)
    assert set(workers) == {0, 1}
    tree = descendants(agent.pid)
    assert len(tree) >= 4  # two ranks, the collector, the resource tracker
    os.kill(workers[1], signal.SIGKILL)
    t0 = time.time()
    _, err = agent.communicate(timeout=90)
    assert agent.returncode != 0
    assert time.time() - t0 < 60, err[-3000:]
    try:
        assert_all_gone(tree, before)
    except AssertionError as e:  # (with what torchrun said, e.g. that it sent SIGKILL)
        raise AssertionError(f"{e}\n{err[-3000:]}") from None


@pytest.mark.slow
def test_two_ranks_resume_with_replay_matches_uninterrupted_run(tmp_path, no_shm_leak):
    """Two ranks sharing two collectors (one env each); a resume continues exactly."""
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    common = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT]
    res = subprocess.run([*common, *SMALL, "--total-timesteps", "1600", "--sync-mode",
                          "lockstep", "--save-interval", "800", "--save-replay",
                          "--num-collectors", "2", "--run-dir", full],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-4000:]
    res = subprocess.run([*common, "--resume", os.path.join(full, "checkpoint_800.pt"),
                          "--run-dir", resumed],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-4000:]
    a, b = summary(full), summary(resumed)
    assert a["num_updates"] == b["num_updates"] and b["total_env_steps"] == 1600
    assert a["rank_param_hashes"] == b["rank_param_hashes"]


@pytest.mark.slow
def test_non_finite_loss_stops_every_rank_at_the_same_step(tmp_path):
    """A diverging update rule under two gloo ranks: both ranks stop at the same env step
    with the diverged status (no rank waits for the other in a collective), and nothing is
    left running or in /dev/shm."""
    before, run_dir = shm_files(), str(tmp_path / "run")
    res = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT, *SMALL,
                          "--total-timesteps", "20000", "--critic-lr", "1e12", "--actor-lr",
                          "1e12", "--run-dir", run_dir, "--dist-timeout", "60"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode != 0
    # (the two ranks' lines may interleave in the agent's stderr: match each lazily)
    found = dict(re.findall(r"rank (\d) error: non-finite .*? at env step (\d+)", res.stderr))
    assert set(found) == {"0", "1"} and found["0"] == found["1"], res.stderr[-3000:]
    assert summary(run_dir)["status"] == "diverged"
    assert_no_leak(before)
