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


@pytest.fixture
def no_shm_leak():
    """Fails the test if it leaves any of our segments in /dev/shm."""
    before = shm_files()
    yield
    leaked = shm_files() - before
    assert not leaked, f"shared memory left behind: {leaked}"


def run_script(script: str, *flags: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env, **kw)
