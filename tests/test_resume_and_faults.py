"""Resume, checkpoints and injected faults, on real short runs."""

import os
import re
import select
import signal
import time

import pytest
import torch
from conftest import (
    SMALL,
    drain,
    run_script,
    script_file,
    script_module,
    updates_shown,
    wait_for_updates,
)
from test_runs import children, read_summary, start_run

pytestmark = pytest.mark.script("fast_sac.py")  # (but for those parametrized by `script`)


def final_params(run_dir):
    ckpt = torch.load(os.path.join(run_dir, "model_final.pt"), weights_only=False)
    return ckpt


def assert_same_params(a, b):
    for net in ("actor", "critics", "critics_target"):
        for key in a[net]:
            assert torch.equal(a[net][key], b[net][key]), f"{net}.{key} differs"


# (fast_sac.py in lockstep and pipelined mode with two collectors on InvertedPendulum: the
# SIGTERM tests in test_preemption.py resume those exactly)
@pytest.mark.parametrize("script, mode, env, collectors", [
    # Reacher: its episodes end by truncation every 50 steps, and VALUE_RANGES lacks it,
    # so the checkpoint carries ReturnRange's state
    ("fast_sac.py", "pipelined", "Reacher-v5", 1),
    ("fast_td3.py", "lockstep", "InvertedPendulum-v5", 2),
])
@pytest.mark.slow
def test_resume_with_replay_matches_uninterrupted_run(script, mode, env, collectors, tmp_path,
                                                      no_shm_leak):
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    flags = [*SMALL, "--env", env, "--sync-mode", mode, "--total-timesteps", "1600",
             "--num-envs", str(2 * collectors), "--num-collectors", str(collectors)]
    res = run_script(script, *flags, "--save-interval", "800", "--save-replay",
                     "--run-dir", full)
    assert res.returncode == 0, res.stderr[-3000:]
    assert os.path.exists(os.path.join(full, "checkpoint_800.pt"))
    assert os.path.exists(os.path.join(full, "checkpoint_800.replay.npz"))
    res = run_script(script, "--resume", os.path.join(full, "checkpoint_800.pt"),
                     "--run-dir", resumed)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = final_params(full), final_params(resumed)
    assert a["num_updates"] == b["num_updates"] and b["global_step"] == 1600
    assert_same_params(a, b)  # (the critics' support too: it is one of their buffers)
    assert (a["value_range"] is None) == (env != "Reacher-v5")
    if a["value_range"]:
        assert (a["value_range"]["lo"], a["value_range"]["hi"]) == (b["value_range"]["lo"],
                                                                  b["value_range"]["hi"])


@pytest.mark.slow
def test_incompatible_resume_is_refused(tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "600", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    for flags, message in ((["--env", "Hopper-v5"], "was trained on Pendulum-v1"),
                           (["--critic-hidden", "64"], "does not match the checkpoint")):
        res = run_script("fast_sac.py", "--resume", run_dir, *flags)
        assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]
    other = run_script("fast_td3.py", "--resume", run_dir)
    assert other.returncode == 2 and "not written by fast_td3.py" in other.stderr


ALL = ["fast_sac.py", "fast_td3.py", "fast_sac_multigpu.py"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ALL)
def test_quiet_run_then_eval_only_prints_mean_and_std(script, tmp_path, no_shm_leak):
    """--quiet prints no progress lines, only the final evaluation; --eval-only on the saved
    policy gives the run's own final evaluation (same seed, same episodes), with the mean
    and std."""
    run_dir = str(tmp_path / "run")
    res = run_script(script, *SMALL, "--total-timesteps", "600", "--eval-episodes", "3",
                     "--quiet", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step " not in res.stdout and "final eval" in res.stdout, res.stdout[-2000:]
    final = read_summary(run_dir)["final_eval_return"]
    res = run_script(script, "--eval-only", "--checkpoint", run_dir,
                     "--eval-episodes", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r"Pendulum-v1: return (-?[\d.]+) \+- ([\d.]+) over 3 deterministic episodes",
                  res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) == round(final, 1) and float(m.group(2)) >= 0


@pytest.mark.slow
@pytest.mark.parametrize("script, collectors", [("fast_sac.py", 1), ("fast_sac.py", 3),
                                                 ("fast_sac_multigpu.py", 1)])
def test_restart_collector_carries_on(script, collectors, tmp_path, no_shm_leak):
    proc, run_dir = start_run(tmp_path, script, "--restart-collector", "--num-envs",
                              str(2 * collectors), "--num-collectors", str(collectors))
    kids = children(proc.pid)
    assert len(kids) == collectors
    victim = kids[-1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.time() + 60
    while time.time() < deadline:  # a new collector appears
        kids = children(proc.pid)
        if len(kids) == collectors and victim not in kids:
            break
        time.sleep(0.2)
    assert len(kids) == collectors and victim not in kids, "no new collector was started"
    # training goes on: the progress lines report more updates than any line before the
    # new collector was there (the learner waited for its chunk meanwhile)
    seen = drain(proc, proc.seen)
    wait_for_updates(proc, above=updates_shown(seen) + 20, seconds=120, text=seen)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert f"restart #1: starting a new collector {collectors - 1}" in err
    s = read_summary(run_dir)
    assert s["status"] == "interrupted" and s["collector_restarts"] == 1


@pytest.mark.parametrize("script", [ALL[0], *(pytest.param(s, marks=pytest.mark.slow)
                                              for s in ALL[1:])])
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(script, tmp_path, no_shm_leak):
    """Updates start after the first checkpoint (at 200 env steps) and diverge at once: that
    checkpoint stays, finite, and nothing is written from the diverged state."""
    run_dir = str(tmp_path / "run")
    res = run_script(script, *SMALL, "--total-timesteps", "20000", "--save-interval",
                     "200", "--learning-starts", "400", "--keep-checkpoints", "100",
                     "--critic-lr", "1e12", "--actor-lr", "1e12", "--run-dir", run_dir)
    assert res.returncode == 1, res.stderr[-3000:]
    m = re.search(r"non-finite .* at env step (\d+)", res.stderr)
    assert m and int(m.group(1)) >= 400, res.stderr[-3000:]
    assert read_summary(run_dir)["status"] == "diverged"
    saved = sorted(f for f in os.listdir(run_dir) if f.endswith(".pt"))
    assert "checkpoint_200.pt" in saved and "model_final.pt" not in saved, saved
    for name in saved:  # every checkpoint that exists is a finite one, taken before it
        state = torch.load(os.path.join(run_dir, name), weights_only=False)
        assert state["global_step"] < int(m.group(1)), name
        for net in ("actor", "critics"):
            for t in state[net].values():
                assert torch.isfinite(t).all(), name


def can_render() -> str | None:
    """None if MuJoCo can render offscreen here, else the reason."""
    import subprocess
    import sys

    code = ("import gymnasium as gym; e = gym.make('InvertedPendulum-v5', render_mode="
            "'rgb_array', width=32, height=32); e.reset(seed=0); assert e.render().shape[0]")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, MUJOCO_GL="egl"))
    return None if res.returncode == 0 else res.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_capture_video_writes_files(tmp_path, no_shm_leak):
    reason = can_render()
    if reason:
        pytest.skip(f"offscreen rendering is not possible here: {reason}")
    run_dir = tmp_path / "run"
    res = run_script("fast_sac.py", *SMALL, "--env", "InvertedPendulum-v5", "--total-timesteps",
                     "800", "--eval-interval", "400", "--capture-video", "--run-dir",
                     str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    videos = sorted(os.listdir(run_dir / "videos"))
    assert len(videos) == 2, videos  # at 400 steps and at the end
    assert all(os.path.getsize(run_dir / "videos" / v) > 1000 for v in videos)


@pytest.mark.slow
def test_plot_draws_curves(tmp_path, no_shm_leak):
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "600", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    out = str(tmp_path / "curves.png")
    res = run_script(os.path.join("benchmarks", "plot.py"), run_dir, "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_progress_bar_on_a_terminal(tmp_path, no_shm_leak):
    """On a terminal the run shows a tqdm bar with env steps, rates, return and ETA."""
    import pty
    import subprocess
    import sys

    from conftest import ROOT

    leader, follower = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, script_file("fast_sac.py")), *SMALL,
                             "--total-timesteps", "800", "--run-dir", str(tmp_path / "r")],
                            cwd=ROOT, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    out, deadline = b"", time.time() + 180
    while time.time() < deadline:  # (a run that hangs fails here instead of hanging)
        if not select.select([leader], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    else:
        proc.kill()
    proc.wait(120)
    os.close(leader)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    assert "800/800" in text and "updates/s" in text and "SPS" in text
    assert "<" in text  # tqdm's elapsed<remaining (ETA)


@pytest.mark.slow
def test_resume_on_another_machine_resolves_its_settings_again(tmp_path, no_shm_leak):
    """A checkpoint from a GPU machine (device, compile, bf16, prefetch), with optimizers
    saved by a version that used foreach kernels, resumed on this CPU machine runs with this
    machine's settings and this version's fused kernels."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "600", "--run-dir", first)
    assert res.returncode == 0, res.stderr[-3000:]
    path = os.path.join(first, "model_final.pt")
    ckpt = torch.load(path, weights_only=False)
    ckpt["args"] |= {"device": "cuda", "compile": True, "amp": True, "prefetch": True}
    for opt in ("actor_opt", "critic_opt", "alpha_opt"):
        for group in ckpt[opt]["param_groups"]:
            group |= {"fused": None, "foreach": True}
    torch.save(ckpt, path)
    res = run_script("fast_sac.py", "--resume", path, "--total-timesteps", "1000", "--run-dir",
                     second)
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = torch.load(os.path.join(second, "model_final.pt"), weights_only=False)
    assert resumed["args"]["device"] == "cpu"
    assert not (resumed["args"]["compile"] or resumed["args"]["amp"]
                or resumed["args"]["prefetch"])
    for opt in ("actor_opt", "critic_opt", "alpha_opt"):
        assert all(g["fused"] and not g["foreach"] for g in resumed[opt]["param_groups"])


@pytest.mark.slow
def test_flags_given_on_resume_override_even_when_they_equal_the_defaults(tmp_path,
                                                                           no_shm_leak):
    """A run saved with --quiet, --save-interval 200 and --log-interval 1, resumed with
    --no-quiet, --save-interval=100000 and --log-interval 10.0: the defaults, given now. And
    a new --critic-lr reaches the optimizer, whose saved state holds the old one."""
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "600", "--quiet",
                     "--save-interval", "200", "--keep-checkpoints", "10", "--run-dir", run_dir)
    assert res.returncode == 0 and "step " not in res.stdout, res.stderr[-3000:]
    before = sorted(f for f in os.listdir(run_dir) if f.startswith("checkpoint_"))
    assert before == ["checkpoint_200.pt", "checkpoint_400.pt"]
    res = run_script("fast_sac.py", "--resume", run_dir, "--no-quiet", "--save-interval=100000",
                     "--total-timesteps", "1000", "--log-interval", "10.0",
                     "--critic-lr", "0.001")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step " in res.stdout  # --no-quiet: progress lines again
    after = sorted(f for f in os.listdir(run_dir) if f.startswith("checkpoint_"))
    assert after == before  # (every 100,000 env steps: none in this run)
    final = final_params(run_dir)
    saved = final["args"]
    assert saved["quiet"] is False and saved["save_interval"] == 100_000
    assert saved["log_interval"] == 10.0 and saved["critic_lr"] == 0.001
    assert [g["lr"] for g in final["critic_opt"]["param_groups"]] == [0.001]
    actor_lr = script_module("fast_sac.py").DEFAULT_LEARNING_RATE  # (Pendulum's: 3e-4)
    assert saved["actor_lr"] == actor_lr
    assert [g["lr"] for g in final["actor_opt"]["param_groups"]] == [actor_lr]


def test_resume_auto_continues_a_single_process_run(tmp_path, no_shm_leak):
    """And "train longer": the finished run's model_final.pt goes on to a larger
    --total-timesteps with its networks, optimizers and counters, while its collectors start
    fresh episodes into an empty buffer, which refills --learning-starts transitions before
    the updates go on (README, "Stop, resume, evaluate")."""
    run_dir = str(tmp_path / "run")
    flags = [*SMALL, "--save-interval", "200", "--resume", "auto", "--run-dir", run_dir]
    res = run_script("fast_sac.py", *flags, "--total-timesteps", "600")
    assert res.returncode == 0 and "resuming" not in res.stdout, res.stderr[-3000:]
    first = final_params(run_dir)
    res = run_script("fast_sac.py", *flags, "--total-timesteps", "1000")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "model_final.pt at env step 600" in res.stdout, res.stdout[-2000:]
    s = read_summary(run_dir)
    assert s["status"] == "completed" and s["total_env_steps"] == 1000
    # 20 iterations of 20 env steps after the resume; the first chunk is skipped (no
    # snapshot: the collectors start at the chunk its weights are for) and the next 10
    # refill the 200 transitions of --learning-starts: 10 iterations of 2 updates remain
    assert s["num_updates"] - first["num_updates"] == 2 * (20 - 1 - 10 + 1)
    assert first["collector"] is None and first["replay"] is None


@pytest.mark.slow
def test_return_range_sums_continue_with_the_collectors_episodes(tmp_path, no_shm_leak):
    """Without --save-replay a checkpoint still carries the collectors' snapshot, so their
    episodes continue on resume, and so do ReturnRange's running sums: in lockstep, before
    --learning-starts (random actions, from restored generators), a resumed run folds in
    exactly the rows an uninterrupted one does, and its support's state at every later
    checkpoint is the same. Reacher (not in VALUE_RANGES) is mid-episode at env step 660."""
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    flags = [*SMALL, "--env", "Reacher-v5", "--sync-mode", "lockstep", "--learning-starts",
             "990", "--total-timesteps", "1000", "--save-interval", "20",
             "--keep-checkpoints", "100"]
    res = run_script("fast_sac.py", *flags, "--run-dir", full)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_script("fast_sac.py", *flags, "--resume", os.path.join(full, "checkpoint_660.pt"),
                     "--run-dir", resumed)
    assert res.returncode == 0 and "at env step 660" in res.stdout, res.stderr[-3000:]
    for name in ("checkpoint_680.pt", "checkpoint_860.pt", "model_final.pt"):
        a, b = (torch.load(os.path.join(d, name), weights_only=False)["value_range"]
                for d in (full, resumed))
        assert (a["g"] == b["g"]).all() and (a["lo"], a["hi"]) == (b["lo"], b["hi"]), name
        assert a["g"].any() or name == "model_final.pt"  # (mid-episode: 340 and 430 steps)


@pytest.mark.parametrize("flag, package", [("--track", "wandb"),
                                           ("--capture-video", "imageio")])
def test_flag_whose_package_is_missing_is_refused(flag, package, tmp_path, no_shm_leak):
    """The package is made unimportable the way Python documents (sys.modules[name] = None,
    in a sitecustomize on PYTHONPATH): the run is refused before anything starts."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    res = run_script("fast_sac.py", *SMALL, flag, "--run-dir", str(tmp_path / "r"),
                     env={"PYTHONPATH": path})
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"{flag} needs the {package} package: pip install {package}" in res.stderr
    assert not (tmp_path / "r").exists()


def test_save_replay_without_the_disk_for_its_files_is_refused(tmp_path, no_shm_leak):
    res = run_script("fast_sac.py", *SMALL, "--save-replay", "--save-interval", "200",
                     "--keep-checkpoints", "100000000", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--save-replay needs" in res.stderr and "for 100000001 replay file(s)" in res.stderr
    assert "GiB free" in res.stderr and not (tmp_path / "r").exists()
