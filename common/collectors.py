"""The collector processes: start, watch, restart and stop them; the sync schedule; snapshots.

A collector is a spawned CPU process (one torch thread, SIGINT and SIGTERM ignored) that
steps its own contiguous slice of the envs chunk by chunk and writes their transitions into
the replay buffer. The harness here runs the chunk loop; the training script passes two
things it owns: `make_env(env_id, num_envs, seed)` (a gymnasium vector env with SAME_STEP
autoreset) and a policy class, `make_policy(args, index, num_envs)`, whose object has
`actor` (the module whose state the learner publishes), `act(obs, random) -> actions`,
`episodes_ended(done)`, `state()` and `restore(state)`. The harness never looks inside an action.

What crosses the process boundary, and who owns it:
- the replay buffer (replay.py), the weights (weights.py) and the Control block (control.py)
  are created and unlinked by the learner; a collector attaches to them, and unlinks them
  only when it finds its learner dead (the last one out cleans up);
- `args` (the script's Args; read here: env, seed, num_envs, num_collectors,
  steps_per_iter, total_timesteps, learning_starts, sync_mode, trace) and a collector's `start`
  dict travel once, pickled, when the process is spawned;
- a snapshot file `.collector_state.{i}.pkl` in the run dir: written by collector i when
  the learner asks for it (Control's snapshot_req), read and removed by the learner.

DESIGN.md (next to the scripts) explains the schedule and the snapshot timing.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from common import trace as T
from common.control import (
    CHUNKS_DONE,
    COLLECT_S,
    FAILED,
    FINISHED,
    LEARNER_PID,
    MAX_REWARD_TERMS,
    RUNNING,
    WEIGHT_LOAD_S,
    WEIGHT_WAIT_S,
    Control,
)
from common.replay import Mirror, ReplayBuffer, batch_nbytes
from common.shm import check_shm_space, replacing
from common.trace import NO_RING_WRITER
from common.weights import WeightSync

# the learner's to handle (StopRequest); collectors ignore them, from their start on
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
TRACE_RING = 16384  # --trace: records per collector's ring (the learner drains it each iteration)


class ArgsError(ValueError):
    """Bad command-line input, reported before any process starts."""


# ---------------------------------------------------------------------------------------
# sizing the processes and the shared memory to the machine (before anything starts)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def default_num_collectors(device: str, num_envs: int) -> int:
    """Collector processes per node. Every GPU learner rank needs about one core to feed
    its GPU, so the others step envs (one collector per 4 envs at most: fewer envs per
    process batch the actor's inference poorly). A CPU learner is the bottleneck of the CPU
    recipe, so it keeps 3/4 of the cores, and on up to 4 cores one collector shares them."""
    cores = available_cores()
    if device == "cuda":
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # (torchrun's ranks per node)
        return max(1, min(cores - 1 - ranks, num_envs // 4))
    return max(1, min(cores // 4, num_envs // 4)) if cores > 4 else 1


def default_learner_threads(num_collectors: int) -> int:
    """The cores the collectors leave free (each collector runs one thread), so that nobody
    shares a core: on 2 cores a second learner thread that shares the collector's core
    gains no updates/s inside a run and slows the collector by about 13% (docs/performance.md)."""
    return max(1, available_cores() - num_collectors)


def check_sizes(args, obs_dim: int, act_dim: int, shm: bool = True) -> None:
    """Raise ArgsError unless the replay buffer can serve a sample, fits in /dev/shm (and,
    with --replay-mirror on CUDA, in the GPU), and --save-replay's files fit on the disk.
    (shm=False: no memory checks, for callers that create no buffers.)"""
    capacity = args.buffer_size // args.num_envs
    chunk = args.steps_per_iter * async_window_chunks(args)
    usable = (capacity - chunk - args.n_step + 1) * args.num_envs
    if capacity < 2 * chunk + args.n_step:
        raise ArgsError(f"--buffer-size {args.buffer_size} gives {capacity} rows per env, too "
                        f"few for --steps-per-iter {args.steps_per_iter}; raise --buffer-size")
    if args.batch_size > usable:
        raise ArgsError(f"--batch-size {args.batch_size} is larger than the {usable} transitions "
                        f"the buffer can offer for sampling; raise --buffer-size (now "
                        f"{args.buffer_size}) or lower --batch-size")
    nbytes = ReplayBuffer.nbytes(args.num_envs, capacity, obs_dim, act_dim)
    try:  # (a default Docker container has only 64 MiB of /dev/shm)
        if shm:
            check_shm_space(nbytes, "The replay buffer")
    except MemoryError as e:
        raise ArgsError(str(e)) from None
    if shm and args.replay_mirror and args.device == "cuda":
        check_mirror_fits(args, obs_dim, act_dim)
    if args.save_replay:  # the kept files and the one being written; without
        # --save-interval, the one that a signal's checkpoint writes
        files = args.keep_checkpoints + 1 if args.save_interval else 1
        where = Path(args.run_dir or "runs").absolute()
        while not where.exists():
            where = where.parent
        need, free = files * nbytes, shutil.disk_usage(where).free
        why = (f"--keep-checkpoints {args.keep_checkpoints} and the one being written"
               if args.save_interval else "the one a signal's checkpoint writes")
        if need > free:
            raise ArgsError(f"--save-replay needs {need / 2**30:.1f} GiB of disk for {files} "
                            f"replay file(s) of {nbytes / 2**30:.2f} GiB ({why}) but {where} "
                            f"has {free / 2**30:.1f} GiB free; lower --buffer-size or "
                            "--keep-checkpoints, or free disk space")


def check_mirror_fits(args, obs_dim: int, act_dim: int) -> None:
    """--replay-mirror on CUDA: the mirror and two samples must fit in this process's GPU
    (torchrun's local rank), next to what the networks need."""
    mirror = Mirror.nbytes(args.num_envs, args.buffer_size // args.num_envs, obs_dim, act_dim)
    sample = batch_nbytes(args.batch_size * args.updates_per_iter, obs_dim, act_dim)
    gpu = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())  # (shared)
    free = torch.cuda.mem_get_info(gpu)[0]
    if mirror + 2 * sample > free:
        raise ArgsError(f"the replay mirror needs {mirror / 2**30:.1f} GiB of GPU memory and "
                        f"{2 * sample / 2**30:.1f} GiB for samples, but {free / 2**30:.1f} GiB "
                        "are free; lower --buffer-size, or pass --replay-mirror False to "
                        "sample on the host")

# ---------------------------------------------------------------------------------------
# the sync schedule (shared by both sides)


def weights_version_for(chunk: int, sync_mode: str) -> int:
    """The weights version a collector acts with in `chunk` (lockstep and pipelined).

    The learner publishes version 0 before training and version i+1 after iteration i.
    """
    return chunk if sync_mode == "lockstep" else max(chunk - 1, 0)


def async_window_chunks(args) -> int:
    """Chunks past the learner's read position that collectors may be writing (the learner
    keeps their rows, the oldest of each ring, out of its samples): the one in flight; in
    async mode a twentieth of the ring (at least 3), and collectors wait rather than run
    further ahead of the learner's newest sample, so it never contains an overwritten row."""
    if args.sync_mode != "async":
        return 1
    return max(3, args.buffer_size // args.num_envs // (20 * args.steps_per_iter))


def num_chunks(args) -> int:
    """Chunks in the whole run: enough to collect --total-timesteps env steps."""
    return math.ceil(args.total_timesteps / (args.num_envs * args.steps_per_iter))


def env_slice(num_envs: int, num_collectors: int, index: int) -> slice:
    """The envs collector `index` steps: contiguous, sizes differing by at most one."""
    bounds = np.linspace(0, num_envs, num_collectors + 1).round().astype(int)
    return slice(int(bounds[index]), int(bounds[index + 1]))


# ---------------------------------------------------------------------------------------
# inside a collector process


class LearnerGone(Exception):
    """The learner process exited while this collector was running."""


def collector_main(make_env, make_policy, args, index: int, rb_spec: dict, ws_spec: dict,
                   ctrl_spec: dict, run_dir: str, start: dict | None = None) -> None:
    """Entry point of collector `index`: collect every chunk, record any error in its
    Control row. `start` continues from a snapshot (or at a chunk, after a restart)."""
    # Ctrl-C and SIGTERM are the learner's to handle: a terminal, `timeout` and a cluster's
    # preemption notice send them to every process of the job, and the learner needs its
    # collectors alive for the checkpoint it takes before it stops them (a collector whose
    # learner is gone exits by itself, see _poll)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # its own session, so that a SIGKILL to the learner's process group (torchrun sends one
    # to a rank that outlives its SIGTERM by 30 s; `kill -9 -- -PGID`) leaves this process
    # to find its learner gone and remove the shared memory, which the learner's resource
    # tracker, killed with the group, no longer can
    with contextlib.suppress(OSError):
        os.setsid()
    with contextlib.suppress(OSError):  # the name that ps -e, top and pgrep show (15 bytes)
        Path("/proc/self/comm").write_text(mp.current_process().name[:15])
    # (the learner blocked both while it started this process, which inherits that mask: a
    # signal sent while this process imported waits, and unblocked now it is discarded)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    torch.set_num_threads(1)
    rb, ws = ReplayBuffer.attach(rb_spec), WeightSync.attach(ws_spec)
    ctrl = Control.attach(ctrl_spec, index)
    parent = mp.parent_process()
    try:
        _collect(make_env, make_policy, args, index, rb, ws, ctrl, parent, run_dir, start)
        ctrl.state = FINISHED
    except BaseException:
        if parent is None or parent.is_alive():
            ctrl.fail(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        # the learner died without cleaning up (also after it asked this process to stop)
        orphaned = parent is not None and not parent.is_alive()
        for mem in (rb, ws, ctrl):
            mem.close()
            if orphaned:
                mem.unlink()


def _poll(read, ctrl: Control, parent):
    """Sleep-poll `read()` until it returns something other than None or False, and return
    that; None if asked to stop first. Raises LearnerGone when the learner exited."""
    sleep = 1e-4
    while not ctrl.stop:
        value = read()
        if value is not None and value is not False:
            return value
        if parent is not None and not parent.is_alive():
            raise LearnerGone("learner process exited")
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.002)
    return None


def _collect(make_env, make_policy, args, index, rb, ws, ctrl, parent, run_dir, start):
    """Collect chunk after chunk, each with the weights the sync mode names, until the last
    one or a stop; a snapshot is written at the chunk the learner asks for."""
    mine = env_slice(args.num_envs, args.num_collectors, index)
    n, S = mine.stop - mine.start, args.steps_per_iter
    policy = make_policy(args, index, n)
    terms = reward_terms(make_env, args.env)
    envs, obs, ep_return, ep_length, ep_terms, first_chunk = _start_envs(
        make_env, args, mine, policy, len(terms), start)
    # --trace: phases go to this collector's ring in the Control block (nothing when off)
    trace = ctrl.trace_writer() if args.trace else NO_RING_WRITER
    loaded, window = -1, async_window_chunks(args)
    for chunk in range(first_chunk, num_chunks(args)):
        step0 = chunk * S
        random_actions = step0 * args.num_envs < args.learning_starts
        trace.counter(T.CHUNK_COUNTER, chunk)
        t0 = time.perf_counter()
        mark = trace.now()
        if args.sync_mode == "async":
            want = None if not random_actions else loaded
            # stay at most one chunk ahead of the slowest collector, and inside the window
            # the learner keeps clear of its samples (async_window_chunks)
            if _poll(lambda: ctrl.slowest() >= chunk - 1
                     and chunk < ctrl.read_chunk + window, ctrl, parent) is None:
                return
        else:
            want = weights_version_for(chunk, args.sync_mode)
        if want is None or want > loaded:  # wait until the version we need is published
            data = _poll(lambda: ws.read(want), ctrl, parent)
            if data is None:
                return
            t1 = time.perf_counter()
            mark = trace.phase(T.WAIT_WEIGHTS, mark)
            if data[0] != loaded and not random_actions:
                ws.load_into(policy.actor, data[1])
            loaded = data[0]
            ctrl.timing[WEIGHT_WAIT_S] += t1 - t0
            ctrl.timing[WEIGHT_LOAD_S] += time.perf_counter() - t1
            mark = trace.phase(T.LOAD_WEIGHTS, mark, loaded)
        if ctrl.snapshot_req > ctrl.snapshot_done and chunk >= ctrl.snapshot_chunk:
            # for a checkpoint: everything needed to collect this chunk and the rest
            with replacing(collector_state_file(run_dir, index)) as f:
                pickle.dump(dict(chunk=chunk, envs=capture_envs(envs), obs=obs,
                                 ep_return=ep_return, ep_length=ep_length, ep_terms=ep_terms,
                                 policy=policy.state()), f)
            ctrl.snapshot_done = ctrl.snapshot_req
            mark = trace.phase(T.SNAPSHOT, mark)
        t0 = time.perf_counter()
        chunk_start = mark = trace.now()
        for s in range(S):
            action = policy.act(obs, random_actions)
            mark = trace.phase(T.ACT, mark)
            next_obs, reward, terminated, truncated, info = envs.step(action)
            done = terminated | truncated
            real_next = _final_obs(next_obs, done, info)
            if terms:
                ep_terms += step_reward_terms(info, terms, n)
            mark = trace.phase(T.ENV_STEP, mark)
            rb.write(mine, step0 + s, obs, action, reward, real_next, terminated, done)
            ep_return += reward
            ep_length += 1
            for i in np.flatnonzero(done):
                ctrl.log_episode(ep_return[i], ep_length[i], (step0 + s + 1) * args.num_envs,
                                 terminated[i], ep_terms[i])
                ep_return[i], ep_length[i], ep_terms[i] = 0.0, 0, 0.0
            policy.episodes_ended(done)
            obs = next_obs
            mark = trace.phase(T.WRITE_ROWS, mark)
        rb.commit(mine, step0 + S)
        ctrl.set_chunk_version(chunk, loaded)
        mark = trace.phase(T.COMMIT, mark)
        trace.slice(T.COLLECT_CHUNK, chunk_start, mark, chunk)  # (ends before the learner
        ctrl.chunks_done = chunk + 1  # can see the chunk)
        ctrl.timing[COLLECT_S] += time.perf_counter() - t0
        if ctrl.stop:
            return
        if parent is not None and not parent.is_alive():
            raise LearnerGone("learner process exited")
    envs.close()


def _start_envs(make_env, args, mine: slice, policy, num_terms: int, start: dict | None):
    """The envs this collector steps, their observations, the running episodes' sums
    (return, length, reward terms) and the first chunk to collect: fresh episodes (a
    restart's envs get new seeds), or exactly where a snapshot left off."""
    n = mine.stop - mine.start
    if start is None or "envs" not in start:
        seed = args.seed * 10_000 + 1000 * (start or {}).get("restart", 0) + mine.start
        envs = make_env(args.env, n, seed)
        obs, _ = envs.reset(seed=[seed + i for i in range(n)])
        return (envs, obs, np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros((n, num_terms)),
                (start or {}).get("chunk", 0))
    policy.restore(start["policy"])
    return (restore_envs(start["envs"]), start["obs"], start["ep_return"], start["ep_length"],
            start.get("ep_terms", np.zeros((n, num_terms))), start["chunk"])


def _final_obs(next_obs: np.ndarray, done: np.ndarray, info: dict) -> np.ndarray:
    """The observations a step's transitions end at: where an episode ended, next_obs is
    already the reset observation, and the true final one (which a truncated episode still
    bootstraps from) is in info."""
    if not done.any():
        return next_obs
    real_next = next_obs.copy()
    for i in np.flatnonzero(info["_final_obs"]):
        real_next[i] = info["final_obs"][i]
    return real_next


def reward_terms(make_env, env_id: str) -> list[str]:
    """The reward terms an env reports in its step info (gymnasium's MuJoCo tasks:
    reward_forward, reward_ctrl, ...), sorted; at most MAX_REWARD_TERMS. Collectors sum them
    per episode; the learner calls this too, so both agree on the order."""
    envs = make_env(env_id, 1, 0)
    envs.reset(seed=0)
    info = envs.step(envs.action_space.sample())[-1]
    envs.close()
    names = sorted(k for k in info if k.startswith("reward_"))
    return names[:MAX_REWARD_TERMS]


def step_reward_terms(info: dict, terms: list[str], n: int) -> np.ndarray:
    """This step's reward terms [n, len(terms)]. An env whose episode ended here was reset
    within the step (SAME_STEP), so its terms are in info["final_info"]."""
    values, final = np.zeros((n, len(terms))), info.get("final_info", {})
    for j, k in enumerate(terms):
        if k in info:
            values[:, j] = info[k]
        if k in final:
            ended = final["_" + k] if "_" + k in final else info["_final_info"]
            values[ended, j] = final[k][ended]
    return values


def capture_envs(envs) -> bytes:
    """A gymnasium SyncVectorEnv's sub-envs, pickled so that their episodes continue exactly.

    Pickling a MuJoCo env rebuilds it from its constructor arguments, so its simulation
    state and random generator are saved beside it.
    """
    import mujoco

    extra = []
    for env in envs.envs:
        u = env.unwrapped
        item = {"np_random": u.np_random.bit_generator.state}
        if isinstance(getattr(u, "data", None), mujoco.MjData):
            kind = mujoco.mjtState.mjSTATE_INTEGRATION
            item["mujoco"] = np.empty(mujoco.mj_stateSize(u.model, kind))
            mujoco.mj_getState(u.model, u.data, item["mujoco"], kind)
        extra.append(item)
    return pickle.dumps({"envs": envs.envs, "extra": extra})


def restore_envs(blob: bytes):
    """Inverse of `capture_envs`: a SyncVectorEnv with SAME_STEP autoreset."""
    import gymnasium as gym
    import mujoco

    saved = pickle.loads(blob)
    for env, item in zip(saved["envs"], saved["extra"]):
        env.unwrapped.np_random.bit_generator.state = item["np_random"]
        if "mujoco" in item:
            u = env.unwrapped
            mujoco.mj_setState(u.model, u.data, item["mujoco"],
                               mujoco.mjtState.mjSTATE_INTEGRATION)
    return gym.vector.SyncVectorEnv([lambda e=e: e for e in saved["envs"]],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def collector_state_file(run_dir: str, index: int) -> str:
    return os.path.join(run_dir, f".collector_state.{index}.pkl")


# ---------------------------------------------------------------------------------------
# the learner's side


class CollectorError(RuntimeError):
    """A collector failed or exited before finishing; `index` says which."""

    def __init__(self, text: str, index: int):
        super().__init__(text)
        self.index = index


class Collectors:
    """The learner's side: one node's shared memory and its collector processes.

    `create` makes the replay buffer, the weights and the Control block (this object owns
    them: `close` stops the processes first, then unlinks them); `attach` maps another
    learner rank's (that rank owns them). `args` is the script's Args (see the module
    docstring; also read here: buffer_size, restart_collector).
    """

    def __init__(self, name: str, args, run_dir: str, rb: ReplayBuffer, ws: WeightSync | None,
                 ctrl: Control, owner: bool = True):
        self.name, self.args, self.run_dir, self.owner = name, args, run_dir, owner
        self.rb, self.ws, self.ctrl = rb, ws, ctrl
        self.procs: list[mp.Process] = []
        self.num_chunks = num_chunks(args)
        self.restarts, self.wait_s, self.reward_terms, self.closed = 0, 0.0, [], False
        self.episodes_seen = [0] * ctrl.num
        self.timing = np.zeros(4)  # the collectors' mean seconds by cause, read at close

    @classmethod
    def create(cls, name: str, args, run_dir: str, actor: torch.nn.Module, obs_dim: int,
               act_dim: int) -> Collectors:
        """Allocate the buffers (the weights sized for `actor`), named after the script
        (/dev/shm/fastrl_{name}_replay_...); no process starts yet."""
        made, prefix = [], f"fastrl_{name}"
        try:
            made.append(ReplayBuffer.create(args.num_envs, args.buffer_size // args.num_envs,
                                            obs_dim, act_dim, prefix))
            made.append(WeightSync.create(actor, prefix))
            made.append(Control.create(args.num_collectors,
                                       TRACE_RING if args.trace else 0, prefix))
            made[-1].all_counters[:, LEARNER_PID] = os.getpid()
        except BaseException:
            for mem in made:
                mem.close()
                mem.unlink()
            raise
        return cls(name, args, run_dir, *made)

    @classmethod
    def attach(cls, name: str, args, run_dir: str, spec: dict) -> Collectors:
        """The buffers another rank created (`spec` is its `.spec`); this side only waits
        and samples: it starts no collectors and publishes no weights."""
        return cls(name, args, run_dir, ReplayBuffer.attach(spec["rb"], untrack=True), None,
                   Control.attach(spec["ctrl"], untrack=True), owner=False)

    @property
    def spec(self) -> dict:
        return {"rb": self.rb.spec, "ctrl": self.ctrl.spec}

    def _spawn(self, index: int, start: dict | None) -> mp.Process:
        proc = mp.get_context("spawn").Process(
            target=collector_main, daemon=True, name=f"{self.name}-coll{index}",
            args=(self.make_env, self.make_policy, self.args, index, self.rb.spec,
                  self.ws.spec, self.ctrl.spec, self.run_dir, start))
        # the new process imports for seconds before collector_main ignores SIGINT and
        # SIGTERM; blocked here, they cannot kill it then (a signal to the whole process group
        # early in a run). Here they wait until the unblock, then reach the learner's handler
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return proc

    def start(self, make_env, make_policy, starts: list[dict | None]) -> None:
        """Start one collector per entry of `starts` (None: fresh, from chunk 0); see the
        module docstring for `make_env` and `make_policy`."""
        self.make_env, self.make_policy = make_env, make_policy
        # the names of the per-episode sums of reward terms the collectors log, in order
        self.reward_terms = reward_terms(make_env, self.args.env)
        self.procs = [self._spawn(i, start) for i, start in enumerate(starts)]
        # at exit, before multiprocessing's own hook: that one joins its children after a
        # SIGTERM, which collectors ignore, so a learner that missed close() (an exception in
        # its own cleanup, say a print to a closed pipe) would wait for them forever
        atexit.register(self.close)

    def resume(self, ckpt: dict) -> tuple[list[dict], int | None]:
        """Before `start`: continue from a checkpoint (common/checkpoints.py), whose learner
        published weights version ckpt["version"] last. Every collector continues from its
        snapshot, or without one starts fresh episodes at the chunk that uses those weights;
        the buffer holds the rows below that chunk from the replay file, or none. Returns
        the collectors' starts and, without a replay file, the env-local step below which
        the buffer holds no data (else None)."""
        S, self.restarts = self.args.steps_per_iter, ckpt["restarts"]
        first = ckpt["version"] + (1 if self.args.sync_mode == "pipelined" else 0)
        starts = ckpt["collector"] or [{"chunk": first, "restart": self.restarts + 1}
                                       ] * self.ctrl.num
        chunk = starts[0]["chunk"]
        if self.owner:
            if ckpt["replay"]:
                loaded = self.rb.load(os.path.join(ckpt["dir"], ckpt["replay"]))
                assert loaded == chunk * S, "replay file and collector snapshot disagree"
            self.rb.commit(slice(None), chunk * S)
            self.ctrl.all_counters[:, CHUNKS_DONE] = chunk
        return starts, None if ckpt["replay"] else chunk * S

    def new_episodes(self) -> np.ndarray:
        """The episodes the collectors finished since the last call, one row each: return,
        length, env step at its end, terminated (1) or truncated, reward terms' sums."""
        self.episodes_seen, episodes = self.ctrl.all_episodes_since(self.episodes_seen)
        return episodes

    def check(self) -> None:
        """Raise CollectorError for the first collector that failed or exited unfinished
        (or, on a rank that attached, when the rank that owns the buffers is gone)."""
        if not self.owner and not _alive(int(self.ctrl.all_counters[0, LEARNER_PID])):
            raise CollectorError("the rank that owns this node's collectors exited", 0)
        for i, proc in enumerate(self.procs):
            row = self.ctrl.row(i)
            if row.state == FAILED or (proc.exitcode is not None and row.state != FINISHED):
                proc.join(1.0)
                text = row.error_text()
                who = "collector" if len(self.procs) == 1 else f"collector {i}"
                raise CollectorError(f"{who} failed (exit code {proc.exitcode})"
                                     + (f":\n{text}" if text else ""), i)

    def wait_until(self, condition) -> None:
        """Sleep-poll `condition` while checking the collectors; the time counts in wait_s."""
        t0, sleep = time.perf_counter(), 1e-4
        try:
            while not condition():
                self.check()
                time.sleep(sleep)
                sleep = min(sleep * 2, 0.001)
        finally:
            self.wait_s += time.perf_counter() - t0

    def wait_for_chunk(self, iteration: int, written: int, agree=None) -> tuple[int, int]:
        """Wait for the rows learner iteration `iteration` trains on; returns how many
        chunks they fill and the rows after them that a write in flight may touch.
        `written`: the env-local steps the last iteration used. `agree(n)` makes several
        learner ranks agree on async progress (the minimum over ranks). A dead collector
        is replaced here with --restart-collector, else CollectorError is raised."""
        args, ctrl, S = self.args, self.ctrl, self.args.steps_per_iter
        while True:
            try:
                if args.sync_mode == "async":
                    # free-running: train on whatever is complete, keeping the chunks that
                    # collectors may be writing out of the sample (before learning starts,
                    # wait for new rows: they are what the learner waits for)
                    seen = written if written * args.num_envs < args.learning_starts else 0
                    self.wait_until(lambda: ctrl.slowest() * S > seen)
                    chunks = agree(ctrl.slowest()) if agree else ctrl.slowest()
                    self.reading(chunks)
                    return chunks, async_window_chunks(args) * S
                # the schedule fixes which rows exist, so timing cannot change the result
                self.wait_until(lambda: ctrl.slowest() > iteration)
                chunks = iteration + 1
                pipelined = args.sync_mode == "pipelined" and chunks < self.num_chunks
                return chunks, S if pipelined else 0
            except CollectorError as e:
                if not (args.restart_collector and self.owner):
                    raise
                self.restart(e)

    def next_chunk(self, chunks: int, window: int, agree=None) -> tuple[int, int] | None:
        """--prefetch: what the next iteration will train on (as `wait_for_chunk` returns
        it), when it is already there, so that its sample can be gathered now (pipelined: it
        is waited for; lockstep has none before the weights are published). None if not.
        `agree(n)`: as in wait_for_chunk."""
        ctrl, S = self.ctrl, self.args.steps_per_iter
        nxt, nxt_window = ctrl.slowest(), window  # async: whatever is complete
        if agree and self.args.sync_mode == "async":
            nxt = agree(nxt)
        if self.args.sync_mode == "pipelined":
            nxt, nxt_window = chunks + 1, S if chunks + 1 < self.num_chunks else 0
            with contextlib.suppress(CollectorError):  # (raised again by wait_for_chunk)
                self.wait_until(lambda: ctrl.slowest() >= nxt)
        if self.args.sync_mode == "lockstep" or ctrl.slowest() < nxt:
            return None
        if self.args.sync_mode == "async":
            self.reading(nxt)
        return nxt, nxt_window

    def policy_lag(self, chunk: int, version: int) -> float | None:
        """How many weight versions older than `version` the collectors' weights for `chunk`
        were, on average (None where this run did not collect it: before a resume)."""
        versions = self.ctrl.chunk_versions(chunk)
        return version - float(versions.mean()) if (versions >= 0).all() else None

    def reading(self, chunks: int) -> None:
        """Async mode: the learner draws a sample from the rows of `chunks` chunks, so the
        collectors must not run more than the window past them (see async_window_chunks)."""
        if self.owner:
            self.ctrl.set_read_chunk(chunks)

    def restart(self, error: CollectorError) -> None:
        """Replace the dead collector `error.index` by a fresh one at its next chunk (its
        envs get new seeds)."""
        i, row = error.index, self.ctrl.row(error.index)
        self.restarts += 1
        print(f"warning: {error}\nrestart #{self.restarts}: starting a new collector {i}",
              file=sys.stderr, flush=True)
        row.stop = True
        _stop(self.procs[i])
        chunk = row.chunks_done
        if chunk > 0:  # the interrupted episodes end at the last complete row: no n-step
            mine = env_slice(self.args.num_envs, self.args.num_collectors, i)  # sum crosses
            self.rb.end_episodes(mine, chunk * self.args.steps_per_iter - 1)  # into new ones
        row.stop, row.state = False, RUNNING
        row.error[:] = 0
        self.procs[i] = self._spawn(i, {"chunk": chunk, "restart": self.restarts})

    def snapshot_chunk(self, chunks: int) -> int | None:
        """The chunk at whose start a checkpoint taken after learning on `chunks` chunks
        must capture the collectors: the first chunk collected with the weights published
        next. None where there is no common one (async collectors drift apart)."""
        chunk = {"lockstep": chunks, "pipelined": chunks + 1}.get(
            self.args.sync_mode, 0 if self.args.num_collectors == 1 else None)
        return chunk if chunk is not None and chunk < self.num_chunks else None

    def ask_snapshot(self, chunk: int) -> None:
        """Ask every collector for its state at the start of `chunk` (asked before the
        weights that chunk needs are published, so no collector is past it)."""
        self.ctrl.ask_snapshot(chunk)

    def snapshots(self) -> list[dict]:
        """Wait for the snapshots asked for and return them, one per collector."""
        self.wait_until(self.ctrl.snapshots_taken)
        out = []
        for i in range(len(self.procs)):
            with open(collector_state_file(self.run_dir, i), "rb") as f:
                out.append(pickle.load(f))
        return out

    def drain_trace(self, trace) -> None:
        """--trace: move the collectors' new timeline records into `trace` (common/trace.py)."""
        trace.drain(self.ctrl, [proc.pid for proc in self.procs])

    def close(self) -> None:
        """Ask every collector to stop, then insist; once all are gone, remove the shared
        memory (owner) and the snapshot files. Once only: later calls do nothing."""
        atexit.unregister(self.close)
        if self.closed:
            return
        self.closed = True
        self.timing = self.ctrl.mean_timing().copy()
        if self.owner:
            self.ctrl.stop_all()
        for proc in self.procs:
            _stop(proc)
        for i in range(len(self.procs)):  # (.tmp: from a collector killed while writing)
            for suffix in ("", ".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(collector_state_file(self.run_dir, i) + suffix)
        for mem in (self.rb, self.ws, self.ctrl):
            if mem is not None:
                mem.close()
                if self.owner:
                    mem.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _stop(proc: mp.Process) -> None:
    """Wait for a collector that was asked to stop; kill it if it lingers (it ignores
    SIGTERM)."""
    proc.join(5.0)
    if proc.exitcode is None:
        proc.kill()
        proc.join()


# ---------------------------------------------------------------------------------------
# signals


class StopRequest:
    """The learner's SIGINT and SIGTERM (collectors ignore both): the first asks for a stop
    after a complete checkpoint at the next iteration; a second one aborts at once
    (KeyboardInterrupt), except a SIGTERM after a SIGTERM: on a cluster the same notice
    comes from the scheduler and again from a launcher that forwards it (torchrun), and the
    checkpoint it asks for is already under way."""

    def __init__(self):
        self.signum, self.t = None, 0.0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        if self.signum is None:
            self.signum, self.t = signum, time.perf_counter()
        elif not signum == self.signum == signal.SIGTERM:
            raise KeyboardInterrupt(f"second signal {signum}")


class Interrupted(Exception):
    """Stopped by a signal after the checkpoint it asked for."""
