"""Learning-curve sweep: train each (script, env, seed) in turn under a wall-time or env-step
budget, then tabulate and plot the deterministic eval return against minutes and env steps.

    python benchmarks/curves.py --scripts fast_sac fast_td3 --envs HalfCheetah-v5 Hopper-v5 \
        --seeds 1 2 --minutes 8 --out-dir curves/

Runs go to OUT/{env}__{script}__{seed}. A finished one is reused when it was made with the same
command (script, env, seed, --steps, --eval-interval, --extra) and --minutes, unless --rerun;
otherwise, and when it was cut off, it runs again from its start: an interrupted sweep
continues with the runs it has not finished. Writes OUT/curves.md (also printed),
OUT/curves.json and OUT/curves.png (needs matplotlib). Minutes count from each process start.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import compact  # noqa: E402

MARK = "curves_run.json"  # in each run dir: how it was run; written when its budget is spent
TAG = "eval/episodic_return"
THRESHOLDS = {"HalfCheetah": [3000, 5000, 7000], "Hopper": [1000, 2500], "Walker2d": [1000, 3000],
              "Ant": [1000, 3000], "Humanoid": [1000, 3000, 5000], "Pendulum": [-1000, -300]}
# SAC's published eval return at 1M env steps, the mark each table row is read against: the
# mean over seeds of the per-seed logs published with SimbaV2 (v4, 10 seeds, the eval nearest
# 1M); Ant: the v5 maintainer's validation runs of SB3's SAC (v5, 10 runs)
SAC_1M = {"HalfCheetah": 11321, "Hopper": 2787, "Walker2d": 4536, "Ant": 4332, "Humanoid": 4826}


@dataclass
class Curves:
    scripts: list[str] = field(default_factory=lambda: ["fast_sac", "fast_td3"])
    envs: list[str] = field(default_factory=lambda: ["HalfCheetah-v5"])
    seeds: list[int] = field(default_factory=lambda: [1])
    minutes: float | None = None
    """wall-time budget per run; the run is stopped with SIGINT (it checkpoints, exits 130)"""
    steps: int | None = None
    """env-step budget per run (--total-timesteps); with --minutes, whichever comes first"""
    eval_interval: int = 10_000
    """env steps between evaluations, i.e. between points of a curve"""
    extra: str = ""
    """further arguments for every run, e.g. "--eval-episodes 3"; they override the above"""
    thresholds: list[str] = field(default_factory=list)
    """returns to time, ENV=R1,R2 (e.g. Hopper=1000,2500), replacing the defaults of that env
    family (HalfCheetah=3000,5000,7000 Hopper=1000,2500 Walker2d=1000,3000 Ant=1000,3000
    Humanoid=1000,3000,5000 Pendulum=-1000,-300, each with SAC's 1M-step score, SAC_1M)"""
    out_dir: str = "curves"
    rerun: bool = False
    """run again even where a run dir has results"""
    table_only: bool = False
    """run nothing; tabulate and plot the run dirs already in --out-dir"""


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def run(c: Curves, script: str, env: str, seed: int, run_dir: str) -> None:
    """One training job under the budget, unless its run dir already has the results of the
    same command and budget."""
    cmd = [sys.executable, os.path.join(ROOT, f"{script}.py"), "--env", env, "--seed", str(seed),
           "--run-dir", run_dir, "--total-timesteps", str(c.steps or 10**10),
           "--eval-interval", str(c.eval_interval), *shlex.split(c.extra)]
    mark = read_json(os.path.join(run_dir, MARK))
    if mark and not c.rerun:
        if (mark["cmd"][1:], mark["minutes"]) == (cmd[1:], c.minutes):
            return print(f"reusing {run_dir}")
        print(f"{run_dir} was run with other arguments or budget ({shlex.join(mark['cmd'][1:])}"
              f", --minutes {mark['minutes']}): running it again")
    shutil.rmtree(run_dir, ignore_errors=True)  # old events would mix with the new ones
    print(f"\n=== {env} {script} seed {seed}: {shlex.join(cmd)}", flush=True)
    t_start, budget_spent = time.time(), False
    proc = subprocess.Popen(cmd)
    try:
        proc.wait(timeout=c.minutes * 60 if c.minutes else None)
    except subprocess.TimeoutExpired:
        budget_spent = True
    finally:  # the budget is spent, or this sweep was interrupted (Ctrl-C, SIGTERM)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # (only the learner: its collectors follow it)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    status = read_json(os.path.join(run_dir, "summary.json")).get("status")
    if not (budget_spent or status in ("completed", "diverged")):
        print(f"{run_dir} exited {proc.returncode} (status {status}); it runs again next time")
        return
    with open(os.path.join(run_dir, MARK), "w") as f:
        json.dump({"cmd": cmd, "t_start": t_start, "wall_s": round(time.time() - t_start, 1),
                   "returncode": proc.returncode, "status": status, "minutes": c.minutes,
                   "steps": c.steps}, f, indent=2)


def load(run_dir: str) -> dict | None:
    """A run's eval curve (env steps, minutes since its process start, returns) and the env
    steps it reached; None when it logged nothing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(run_dir):
        return None
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    if not (tags := events.Tags()["scalars"]):
        return None
    mark = read_json(os.path.join(run_dir, MARK))
    t0 = mark.get("t_start") or events.FirstEventTimestamp()
    points = events.Scalars(TAG) if TAG in tags else []
    summary = read_json(os.path.join(run_dir, "summary.json"))
    return {"steps": np.array([p.step for p in points]),
            "minutes": np.array([(p.wall_time - t0) / 60 for p in points]),
            "returns": np.array([p.value for p in points]),
            "budget": describe(mark.get("minutes"), mark.get("steps")),
            "cmd": shlex.join(["python", *(os.path.relpath(a, ROOT) if a.startswith(ROOT)
                                           else a for a in mark.get("cmd", ["?"])[1:])]),
            "reached": max([summary.get("total_env_steps", 0)]
                           + [events.Scalars(t)[-1].step for t in tags])}


def stats(runs: list[dict], thr: list[float]) -> dict:
    """Per-seed figures of one (env, script): steps reached, final and best eval return, the
    mean of the last three evals (what a user meets, late collapses included) and its share
    of the best, and minutes to the first eval at or above each threshold (None: none, or
    not reached)."""
    def first(r, x):
        return float(r["minutes"][np.argmax(r["returns"] >= x)]) if (r["returns"] >= x).any() \
            else None
    best = [float(r["returns"].max()) if len(r["returns"]) else None for r in runs]
    last = [float(r["returns"][-3:].mean()) if len(r["returns"]) else None for r in runs]
    return {"seeds": [r["seed"] for r in runs], "env_steps": [int(r["reached"]) for r in runs],
            "final_eval": [float(r["returns"][-1]) if len(r["returns"]) else None for r in runs],
            "best_eval": best, "last_three": last,
            "of_best": [a / b if b is not None and b > 0 else None for a, b in zip(last, best)],
            "minutes_to": {f"{x:g}": [first(r, x) for r in runs] for x in thr}}


def cell(values: list, fmt: str) -> str:
    """Median over seeds, then the per-seed values; k/n when only k seeds have one."""
    have = [v for v in values if v is not None]
    if not have:
        return "-"
    show = (lambda v: compact(float(f"{v:.3g}"))) if fmt == "steps" else fmt.format
    head = show(float(np.median(have))) if len(have) == len(values) else \
        f"{len(have)}/{len(values)}"
    seeds = ", ".join("-" if v is None else show(v) for v in values)
    return head + (f" ({seeds})" if len(values) > 1 else "")


def describe(minutes: float | None, steps: int | None) -> str:
    return " and ".join(f"--{k} {v:g}" for k, v in (("minutes", minutes), ("steps", steps))
                        if v is not None) or "none"


def table(c: Curves, curves: dict, thresholds: dict) -> tuple[str, list[dict]]:
    lines, rows = [f"Eval return ({TAG}): median over seeds (per-seed values); last three = "
                   "the mean of the last three evals; minutes from process start.", "",
                   made_with(), ""], []
    for env in c.envs:
        thr, sac = thresholds.get(family(env), []), SAC_1M.get(family(env))
        budgets = sorted({r["budget"] for (e, *_), r in curves.items() if e == env})
        lines += [f"### {env}", "", f"Budget per run: {'; '.join(budgets) or '-'}."
                  + (f" SAC's published eval return at 1M env steps: {sac:,}." if sac else ""),
                  "", "| script | seeds | env steps | last three evals | best eval | last three "
                  "/ best |" + "".join(f" min to {x:g} |" for x in thr), "|---" * (6 + len(thr))
                  + "|"]
        for script in c.scripts:
            if runs := [r for s in c.seeds if (r := curves.get((env, script, s)))]:
                row = {"env": env, "script": script} | stats(runs, thr)
                rows.append(row)
                lines.append(f"| {script} | {len(runs)} | {cell(row['env_steps'], 'steps')} | "
                             f"{cell(row['last_three'], '{:.0f}')} | "
                             f"{cell(row['best_eval'], '{:.0f}')} | "
                             f"{cell(row['of_best'], '{:.2f}')} |"
                             + "".join(f" {cell(v, '{:.1f}')} |"
                                       for v in row["minutes_to"].values()))
        cmds = [r["cmd"] for (e, *_), r in sorted(curves.items()) if e == env]
        lines += ["", "Each run's command:", "", "```", *cmds, "```", ""] if cmds else [""]
    return "\n".join(lines), rows


def made_with() -> str:
    """Where and with what the tabulating ran: the CPU model, the date, the commit and the
    versions (the runs' own machine, when they were made elsewhere, is not known here)."""
    import platform

    import gymnasium
    import mujoco
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "?")
    commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip() or "?"
    return (f"Made on {cpu} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}, commit "
            f"{commit}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"gymnasium {gymnasium.__version__}, MuJoCo {mujoco.__version__}.")


def draw(c: Curves, curves: dict, thresholds: dict, path: str) -> None:
    """Eval return against minutes (top row) and env steps (bottom), one column per env:
    each seed a thin line, the median over seeds (where they all have points) a thick one."""
    try:
        import matplotlib
    except ImportError:
        return print("no curves.png: matplotlib is not installed (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(2, len(c.envs), figsize=(4.5 * len(c.envs), 7), squeeze=False)
    for col, env in enumerate(c.envs):
        for ax, x in zip(axes[:, col], ("minutes", "steps")):
            for i, script in enumerate(c.scripts):
                runs = [r for s in c.seeds if (r := curves.get((env, script, s)))
                        and len(r["returns"])]
                n, colour = len(runs), f"C{i}"
                for r in runs:
                    ax.plot(r[x], r["returns"], color=colour, lw=0.8 if n > 1 else 2.2,
                            alpha=0.4 if n > 1 else 1)
                lo = max((r[x][0] for r in runs), default=0)
                hi = min((r[x][-1] for r in runs), default=0)
                if n > 1 and lo < hi:
                    grid = np.linspace(lo, hi, 200)
                    curve = np.median([np.interp(grid, r[x], r["returns"]) for r in runs], 0)
                    ax.plot(grid, curve, color=colour, lw=2.2)
                if n:  # (the legend's entry)
                    seeds = f"{n} seed" + "s" * (n > 1)
                    ax.plot([], [], color=colour, lw=2.2, label=f"{script} ({seeds})")
            for y in thresholds.get(family(env), []):
                ax.axhline(y, color="grey", lw=0.6, ls=":")
            ax.set_xlabel("wall time (minutes)" if x == "minutes" else "env steps")
            ax.xaxis.set_major_formatter(FuncFormatter(compact))
            ax.grid(alpha=0.3)
        axes[0, col].set_title(env)
        if axes[0, col].get_legend_handles_labels()[0]:
            axes[0, col].legend(fontsize=8)
    axes[0, 0].set_ylabel("eval return")
    axes[1, 0].set_ylabel("eval return")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def family(env: str) -> str:
    return env.split("-v")[0]


def main(c: Curves) -> None:
    if not (c.minutes or c.steps or c.table_only):
        raise SystemExit("give a budget: --minutes, --steps or both (or --table-only)")
    # minutes to SAC's 1M-step figure, after the family's own marks
    thresholds = {f: sorted(set(v) | {SAC_1M[f]} if f in SAC_1M else set(v))
                  for f, v in THRESHOLDS.items()}
    for spec in c.thresholds:
        env, _, values = spec.partition("=")
        thresholds[family(env)] = [float(v) for v in values.split(",") if v]
    c.scripts = [s.removesuffix(".py") for s in c.scripts]
    os.makedirs(c.out_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops the running job too
    curves = {}
    try:
        for env in c.envs:
            for script in c.scripts:
                for seed in c.seeds:
                    run_dir = os.path.join(c.out_dir, f"{env}__{script}__{seed}")
                    if not c.table_only:
                        run(c, script, env, seed, run_dir)
                    if (curve := load(run_dir)) is not None:
                        curves[env, script, seed] = curve | {"seed": seed}
    except KeyboardInterrupt:
        raise SystemExit("interrupted: run the same command again to continue") from None
    text, rows = table(c, curves, thresholds)
    print("\n" + text)
    with open(os.path.join(c.out_dir, "curves.md"), "w") as f:
        f.write(text)
    with open(os.path.join(c.out_dir, "curves.json"), "w") as f:
        json.dump({"args": vars(c), "rows": rows, "thresholds": {
            family(e): thresholds.get(family(e), []) for e in c.envs}}, f, indent=2)
    draw(c, curves, thresholds, os.path.join(c.out_dir, "curves.png"))


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--extra" in argv[:-1]:  # tyro would take a value such as "--eval-episodes 3" for a flag
        i = argv.index("--extra")
        argv[i:i + 2] = [f"--extra={argv[i + 1]}"]
    main(tyro.cli(Curves, args=argv))
