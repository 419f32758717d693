"""The run metrics practitioners read (episode ends by cause, reward terms, replay ratio,
policy lag, the learner's waits, Q range, gradient norms, action std), from short real runs."""

import json
import math
import os

import pytest
from conftest import SMALL, run_script


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def run(tmp_path, script, *flags):
    run_dir = str(tmp_path / "run")
    res = run_script(script, *SMALL, "--total-timesteps", "1000", "--run-dir", run_dir, *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        return scalars(run_dir), json.load(f)


def values(tags, tag):
    assert tag in tags, f"{tag} not logged; tags: {sorted(tags)}"
    return [v for _, v in tags[tag]]


def check_learner_metrics(tags, summary, support=(-1700, 0), batch_size=32, min_logs=2):
    q_min, q_max = values(tags, "losses/qf_min"), values(tags, "losses/qf_max")
    lowest, highest = support  # (expected values of distributions on the critics' support)
    assert summary["num_updates"] > 0
    assert len(q_min) >= min_logs
    assert all(lowest <= lo < hi <= highest for lo, hi in zip(q_min, q_max))
    for tag in ("losses/critic_grad_norm", "losses/actor_grad_norm", "losses/action_std"):
        assert all(math.isfinite(v) and v > 0 for v in values(tags, tag)), tag
    # transitions sampled per transition collected
    ratio = summary["num_updates"] * batch_size / summary["total_env_steps"]
    assert summary["replay_ratio"] == pytest.approx(ratio, abs=1e-3)
    assert values(tags, "charts/replay_ratio")[-1] == pytest.approx(ratio, abs=1e-3)
    # the learner's waiting, by cause (for collectors, for the sample)
    assert summary["perf"]["wait_s"] > 0 and summary["perf"]["sample_s"] > 0
    assert "perf/sample_time" in tags and "perf/wait_time" in tags


@pytest.mark.slow
@pytest.mark.script("fast_sac.py")
def test_hopper_episodes_end_by_termination_and_report_reward_terms(tmp_path, no_shm_leak):
    tags, summary = run(tmp_path, "fast_sac.py", "--env", "Hopper-v5", "--sync-mode",
                        "lockstep")
    assert summary["episodes_terminated"] > 5 and summary["episodes_truncated"] == 0
    assert set(values(tags, "charts/terminated_rate")) == {1.0}
    assert set(values(tags, "charts/truncated_rate")) == {0.0}
    # Hopper's reward is forward + survive + ctrl (ctrl is negative): the per-episode sums
    # of the terms add up to the episode's return, the final step (reported in final_info,
    # since the env resets within the step) included
    returns = dict(tags["charts/episodic_return"])
    terms = [dict(tags[f"charts/episodic_reward_{k}"]) for k in ("forward", "survive", "ctrl")]
    assert len(returns) > 5 and all(set(t) == set(returns) for t in terms)
    for step, ret in returns.items():
        assert sum(t[step] for t in terms) == pytest.approx(ret, rel=1e-4, abs=1e-3)
    assert all(v > 0 for v in terms[1].values()) and all(v < 0 for v in terms[2].values())
    # lockstep: every chunk is collected with the newest weights
    assert set(values(tags, "charts/policy_lag")) == {0.0} and summary["policy_lag"] == 0
    check_learner_metrics(tags, summary, support=(-100, 600))


@pytest.mark.script("fast_sac.py")
def test_pendulum_episodes_end_by_truncation(tmp_path, no_shm_leak):
    tags, summary = run(tmp_path, "fast_sac.py", "--sync-mode", "pipelined")
    assert summary["episodes_truncated"] == 4 and summary["episodes_terminated"] == 0
    assert set(values(tags, "charts/truncated_rate")) == {1.0}
    assert not any(tag.startswith("charts/episodic_reward_") for tag in tags)  # it has none
    # pipelined: one version behind, except chunk 0 (collected with version 0 like chunk 1)
    lag = values(tags, "charts/policy_lag")
    assert all(0 <= v <= 1 for v in lag) and lag[-1] == 1.0
    assert 0.95 < summary["policy_lag"] < 1
    check_learner_metrics(tags, summary)


@pytest.mark.script("fast_td3.py")
def test_td3_async_metrics(tmp_path, no_shm_leak):
    tags, summary = run(tmp_path, "fast_td3.py", "--sync-mode", "async")
    lag = values(tags, "charts/policy_lag")
    assert all(v >= 0 for v in lag) and summary["policy_lag"] >= 0
    # async: how many iterations the learner makes of 1000 env steps depends on the
    # machine's load (one, when the collector finishes first), so one log may be all
    check_learner_metrics(tags, summary, min_logs=1)
