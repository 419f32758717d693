"""The scripts repeat their plumbing on purpose (each is a complete program to copy), so the
repeated parts must stay identical: a fix made in one script only fails here. A --script
copy is compared in its original's place (marked `algorithm`: a copy's changes may differ)."""

import ast
import os

import pytest
from conftest import ROOT, script_file

# top-level definitions that are the variant itself; everything else both scripts define
# must be the same text
VARIANT = {
    "fast_td3.py": {"Args", "resolve_args", "check_args", "Actor", "make_actor", "Explorer",
                    "Learner", "fast_path_default", "LEARNING_RATE"},
    "fast_sac_multigpu.py": {"Args", "Learner", "train", "Run", "start_collectors",
                             "fold_in_new_rows", "log_iteration", "timers", "replay_ratio",
                             "evaluate_policy", "finish_run", "write_trace", "save_checkpoint",
                             "restore", "main"},
}


def definitions(script: str) -> dict[str, str]:
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = ast.get_source_segment(source, node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.get_source_segment(source, node)
    return out


@pytest.mark.algorithm
@pytest.mark.parametrize("variant", sorted(VARIANT))
def test_shared_definitions_are_identical_text(variant):
    files = script_file("fast_sac.py"), script_file(variant)
    base, other = map(definitions, files)
    shared = sorted(set(base) & set(other) - VARIANT[variant])
    assert len(shared) > 25  # the plumbing really is shared, not renamed away
    drifted = [name for name in shared if base[name] != other[name]]
    assert not drifted, f"{files[1]} and {files[0]} differ in {drifted}; change both alike"
    # the list of variant parts stays honest: each one really differs
    assert all(base[name] != other[name] for name in VARIANT[variant] if name in base)
