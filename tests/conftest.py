import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# tiny networks and batches: these runs check plumbing, not learning
SMALL = ["--env", "Pendulum-v1", "--num-envs", "2", "--batch-size", "32", "--actor-hidden", "32",
         "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "200",
         "--steps-per-iter", "10", "--updates-per-iter", "2", "--buffer-size", "20000",
         "--eval-episodes", "1", "--eval-interval", "0", "--log-interval", "1"]


def shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/fastrl_*"))


def leaked(before: set[str]) -> set[str]:
    """Segments that appeared since `before` and outlive the process that made them (its
    pid is in the name), or that this test process made: a training run of someone else's
    on the same machine, whose segments come and go with it, is no leak."""
    def orphan(path: str) -> bool:
        pid = int(os.path.basename(path).split("_")[-2])
        return pid == os.getpid() or not os.path.exists(f"/proc/{pid}")
    return {f for f in shm_files() - before if orphan(f)}


@pytest.fixture
def no_shm_leak():
    """Fails the test if it leaves any of our segments in /dev/shm."""
    before = shm_files()
    yield
    left = leaked(before)
    assert not left, f"shared memory left behind: {left}"


def run_script(script: str, *flags: str, timeout: float = 300, env: dict | None = None,
               **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env, **kw)
