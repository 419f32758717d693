import difflib
import glob
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# one torch thread in the test processes themselves, as a collector has (the runs that the
# tests start choose their own): with two threads on a 2-core machine whose other core was
# busy, a unit test's tiny critic update took 14 ms against 2.5 ms with one
torch.set_num_threads(1)

# --script FILE: a researcher's copy of one of these (README: cp fast_sac.py my_sac.py) stands
# in for it in every test, and the tests of the other two are skipped. A test says which of
# them it runs or imports with a `script` parameter, else with pytest.mark.script(*names)
# (on the test, or as its module's pytestmark); a test with neither runs whatever the copy.
ORIGINALS = ("fast_sac.py", "fast_td3.py", "fast_sac_multigpu.py")
COPY: tuple[str, str] | None = None  # (the copy's file name, the original it was copied from)


def pytest_addoption(parser):
    parser.addoption("--script", metavar="FILE", help=(
        "a copy of fast_sac.py, fast_td3.py or fast_sac_multigpu.py next to them (the one "
        "whose text it is closest to): it stands in for that one in every test, and the "
        "tests of the other two are skipped"))


def pytest_configure(config):
    global COPY
    path = config.getoption("--script")
    if not path:
        return
    name = os.path.basename(path)
    if not os.path.isfile(path) or os.path.dirname(os.path.abspath(path)) != ROOT:
        raise pytest.UsageError(f"--script {path}: no such file in {ROOT} (copy the script "
                                "there, next to the originals: it imports common/)")
    if not name.endswith(".py") or not name.removesuffix(".py").isidentifier():
        raise pytest.UsageError(f"--script {path}: the tests import it as a module, so its "
                                "name must be one, e.g. my_sac.py")
    COPY = (name, copied_from(path))


def copied_from(path: str) -> str:
    """The original whose text `path`'s is closest to, line by line: a copy whose algorithm
    was rewritten still shares the rest, most of its lines, with the one it came from."""
    def lines(file):
        with open(file) as f:
            return f.read().splitlines()

    copy = lines(path)
    return max(ORIGINALS, key=lambda name: difflib.SequenceMatcher(
        None, copy, lines(os.path.join(ROOT, name)), autojunk=False).ratio())


def pytest_report_header(config):
    if COPY:
        return f"--script {COPY[0]}: a copy of {COPY[1]}, tested in its place"


def pytest_collection_modifyitems(config, items):
    """With --script, skip the tests that concern only other originals than the copy's."""
    if COPY is None:
        return
    for item in items:
        callspec, mark = getattr(item, "callspec", None), item.get_closest_marker("script")
        if callspec and "script" in callspec.params:
            names = [callspec.params["script"]]
        elif mark:
            names = mark.args
        else:
            continue
        if COPY[1] not in names:
            item.add_marker(pytest.mark.skip(
                reason=f"a test of {' and '.join(names)}; --script {COPY[0]} copies {COPY[1]}"))


def script_file(name: str) -> str:
    """The file to run for the original `name` (e.g. "fast_sac.py"): the --script copy if it
    was copied from `name`, else `name`."""
    return COPY[0] if COPY and COPY[1] == name else name


def script_module(name: str):
    """script_file(name) imported as a module, by its own name: the collector processes that
    a script starts import it again by that name (to unpickle Explorer and make_env)."""
    return importlib.import_module(script_file(name).removesuffix(".py"))


# tiny networks and batches: these runs check plumbing, not learning (eager: the tests
# choose the speed flags themselves, so that a long run never spends a minute compiling)
SMALL = ["--env", "Pendulum-v1", "--num-envs", "2", "--batch-size", "32", "--actor-hidden", "32",
         "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "200",
         "--steps-per-iter", "10", "--updates-per-iter", "2", "--buffer-size", "20000",
         "--eval-episodes", "1", "--eval-interval", "0", "--log-interval", "1",
         "--compile", "False", "--amp", "False"]


def checkpoints(run_dir: str) -> list[int]:
    """The env steps of run_dir's checkpoint_*.pt files, oldest first."""
    return sorted(int(m.group(1)) for f in os.listdir(run_dir)
                  if (m := re.fullmatch(r"checkpoint_(\d+)\.pt", f)))


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


def assert_no_leak(before: set[str], seconds: float = 30) -> None:
    """Polls until no segment counted by `leaked(before)` is left; fails at the deadline (a
    process that exits removes its segments a moment later, not at once)."""
    import time

    deadline = time.time() + seconds
    while leaked(before) and time.time() < deadline:
        time.sleep(0.1)
    assert not leaked(before), f"shared memory left behind: {leaked(before)}"


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs nothing and holds no segment)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


def wait_gone(pid: int, seconds: float) -> bool:
    import time

    deadline = time.time() + seconds
    while time.time() < deadline and not gone(pid):
        time.sleep(0.1)
    return gone(pid)


def assert_all_gone(pids, before: set[str], seconds: float = 30) -> None:
    """Every process in `pids` exits within `seconds` and leaves no segment in /dev/shm."""
    import time

    deadline = time.time() + seconds
    left = [p for p in pids if not wait_gone(p, deadline - time.time())]
    assert not left, f"processes left: {left}"
    assert_no_leak(before, seconds)


@pytest.fixture
def no_shm_leak():
    """Fails the test if it leaves any of our segments in /dev/shm. (Polled: a test that
    runs beside this one, under pytest -n, may have killed a process whose segments its
    collector removes a moment later.)"""
    before = shm_files()
    yield
    assert_no_leak(before)


def run_script(script: str, *flags: str, timeout: float = 300, env: dict | None = None,
               **kw) -> subprocess.CompletedProcess:
    """Runs `script` (script_file's: the --script copy in its original's place)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, os.path.join(ROOT, script_file(script)), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
                          **kw)


def read_until(proc, done, seconds: float = 300, text: str = "") -> str:
    """Read `proc`'s stdout (a pipe) until `done(text so far)` is true; returns the text.
    Fails at the deadline, or when the process ends first: a stuck run fails the test
    instead of hanging it."""
    import select
    import time

    fd, deadline = proc.stdout.fileno(), time.time() + seconds
    while not done(text):
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"timed out after {seconds} s; output so far:\n{text[-2000:]}")
        ready, _, _ = select.select([fd], [], [], 0.5)
        chunk = os.read(fd, 65536).decode(errors="replace") if ready else ""
        if ready and not chunk:  # end of output: the run is over
            proc.wait()
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the run ended (exit {proc.returncode}) first:\n"
                                 f"{text[-2000:]}\n{(err or '')[-3000:]}")
        text += chunk
    return text


def updates_shown(text: str) -> int:
    """The most gradient updates that the progress lines in `text` report."""
    import re

    return max((int(m.replace(",", "")) for m in re.findall(r"updates\s+([\d,]+)", text)),
               default=0)


def wait_for_updates(proc, above: int = 0, seconds: float = 300, text: str = "") -> str:
    """Read `proc`'s progress lines until they report more than `above` updates."""
    return read_until(proc, lambda t: updates_shown(t) > above, seconds, text)


def drain(proc, text: str = "", quiet_s: float = 0.3) -> str:
    """`text` plus whatever `proc` has written to its stdout pipe by now (reads until the pipe
    has been empty for `quiet_s`)."""
    import select

    fd = proc.stdout.fileno()
    while select.select([fd], [], [], quiet_s)[0]:
        chunk = os.read(fd, 65536).decode(errors="replace")
        if not chunk:
            break
        text += chunk
    return text
