"""What a researcher's copy meets: resuming a copied run dir, a checkpoint whose tensors do
not fit the networks built now, and the rates a resumed run reports."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from conftest import SMALL, run_script

pytestmark = pytest.mark.script("fast_sac.py")


def tree_digest(path: str) -> dict[str, str]:
    """Every file under `path` (relative name -> sha256 of its bytes)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_resume_of_a_copied_run_dir_writes_into_the_copy(tmp_path, no_shm_leak):
    """A run dir copied and resumed: the resumed run writes into the copy (its checkpoints,
    events and summary), and the original stays byte for byte as it was, although the
    checkpoint's saved --run-dir names the original. The resumed run's rates count from the
    resume point: its collectors' steps/s times their seconds is the env steps collected
    since then, not since step 0."""
    original, copy = str(tmp_path / "run"), str(tmp_path / "copy")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "1000", "--save-interval",
                     "400", "--run-dir", original)
    assert res.returncode == 0, res.stderr[-3000:]
    shutil.copytree(original, copy)
    before = tree_digest(original)
    resumed_at = torch.load(os.path.join(copy, "checkpoint_800.pt"), weights_only=False)
    res = run_script("fast_sac.py", "--resume", os.path.join(copy, "checkpoint_800.pt"),
                     "--total-timesteps", "2000")
    assert res.returncode == 0, res.stderr[-3000:]
    assert tree_digest(original) == before
    with open(os.path.join(copy, "summary.json")) as f:
        s = json.load(f)
    assert s["status"] == "completed" and s["total_env_steps"] == 2000
    assert os.path.exists(os.path.join(copy, "checkpoint_1600.pt"))
    perf = s["perf"]
    assert abs(perf["collector_steps_per_s"] * perf["collect_s"] - (2000 - 800)) < 0.02 * 1200
    updates_since = s["num_updates"] - resumed_at["num_updates"]
    assert 0 < updates_since < s["num_updates"]
    assert abs(perf["learner_updates_per_s"] * perf["learn_s"] - updates_since) < 0.02 * (
        updates_since)


def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(tmp_path, no_shm_leak):
    """A checkpoint whose tensors do not fit the networks built now (here a critic layer of
    another width, as a copy with a new shape argument would save): the resume is refused
    with one line naming the first mismatched tensor and both shapes, before any process
    starts or any file is written; --eval-only refuses an actor that does not fit alike."""
    run_dir = str(tmp_path / "run")
    res = run_script("fast_sac.py", *SMALL, "--total-timesteps", "600", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    path = os.path.join(run_dir, "model_final.pt")
    ckpt = torch.load(path, weights_only=False)
    ckpt["critics"]["net.0.weight"] = torch.zeros(10, 24, 32)  # (10 critics where 2 are built)
    ckpt["actor"]["trunk.0.weight"] = torch.zeros(64, 3)
    torch.save(ckpt, path)
    before = tree_digest(run_dir)
    res = run_script("fast_sac.py", "--resume", path, "--total-timesteps", "2000")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "actor.trunk.0.weight is [64, 3] there and [32, 3] here" in lines[0], lines[0]
    assert tree_digest(run_dir) == before
    res = run_script("fast_sac.py", "--eval-only", "--checkpoint", path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "actor.trunk.0.weight is [64, 3] there and [32, 3] here" in res.stderr
