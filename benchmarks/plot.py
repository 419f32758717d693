"""Learning curves from run dirs' TensorBoard events, against env steps and wall time.

    python benchmarks/plot.py runs/HalfCheetah-v5__fast_sac__1__* runs/...td3... --out curves.png
    python benchmarks/plot.py runs/... --tag charts/episodic_return --smooth 50
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import tyro


@dataclass
class Plot:
    run_dirs: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """run directories (each with events.out.tfevents.*)"""
    tag: str = "eval/episodic_return"
    """scalar to plot; charts/episodic_return for training returns"""
    out: str = "curves.png"
    """PNG to write"""
    smooth: int = 1
    """moving average over this many points (training returns are noisy: try 20-100); the
    raw curve stays faint behind the smoothed one. 1: no smoothing"""


def load(run_dir: str, tag: str) -> tuple[list[float], list[float], list[float]]:
    """(env steps, minutes since the run's first event, values) of `tag`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        raise SystemExit(f"{run_dir} has no scalar '{tag}'; it has {events.Tags()['scalars']}")
    points = events.Scalars(tag)
    t0 = min(e.wall_time for t in events.Tags()["scalars"] for e in events.Scalars(t)[:1])
    return ([p.step for p in points], [(p.wall_time - t0) / 60 for p in points],
            [p.value for p in points])


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to `window - 1` before it (the first points average
    over fewer, so the curve starts at the first value rather than lagging behind)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compact(x: float, _pos=None) -> str:
    """Tick label for a step count: 25k, 100k, 1.5M."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= size:
            return f"{x / size:g}{suffix}"
    return f"{x:g}"


def describe(run_dir: str) -> tuple[str | None, str | None, object]:
    """(env, script, seed) of a run, from its summary.json and its default name
    {env}__{script}__{seed}__{timestamp}; None where neither tells."""
    parts = os.path.basename(os.path.normpath(run_dir)).split("__")
    env, script, seed = parts[:3] if len(parts) == 4 else (None, None, None)
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        env, seed = summary.get("env_id", env), summary.get("seed", seed)
    except (OSError, ValueError):
        pass  # still running, or stopped before writing it
    return env, script, seed


def labels(run_dirs: list[str]) -> tuple[list[str], str | None]:
    """Legend labels ("script seed N", led by the env when several are plotted) and the one
    env of all runs, if they share one. A run that is not named that way, or whose label
    would repeat another's, is labelled with its dir name."""
    runs = [describe(d) for d in run_dirs]
    envs = {env for env, _, _ in runs}
    out = [(f"{env} " if len(envs) > 1 else "") + f"{script} seed {seed}" if script else None
           for env, script, seed in runs]
    out = [label if label and out.count(label) == 1 else os.path.basename(os.path.normpath(d))
           for label, d in zip(out, run_dirs)]
    return out, next(iter(envs)) if len(envs) == 1 else None


def main(p: Plot) -> None:
    if not p.run_dirs:
        raise SystemExit("give at least one run directory")
    for run_dir in p.run_dirs:
        if not os.path.isdir(run_dir):
            raise SystemExit(f"{run_dir} is not a run directory")
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot.py draws with matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    names, env = labels(p.run_dirs)
    if p.smooth < 1:
        raise SystemExit(f"--smooth must be at least 1, got {p.smooth}")
    for run_dir, label in zip(p.run_dirs, names):
        steps, minutes, values = load(run_dir, p.tag)
        for ax, x in ((by_step, steps), (by_time, minutes)):
            if p.smooth > 1:
                raw = ax.plot(x, values, alpha=0.2, linewidth=0.8)[0]
                ax.plot(x, moving_average(values, p.smooth), color=raw.get_color(),
                        label=label if ax is by_step else None)
            else:
                ax.plot(x, values, label=label if ax is by_step else None)
    by_step.set_xlabel("environment steps")
    by_step.xaxis.set_major_formatter(FuncFormatter(compact))
    by_time.set_xlabel("wall time (minutes)")
    by_step.set_ylabel(p.tag + (f" (moving average of {p.smooth})" if p.smooth > 1 else ""))
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    if env:
        fig.suptitle(env)
    fig.tight_layout()
    fig.savefig(p.out, dpi=120)
    print(f"wrote {p.out}")


if __name__ == "__main__":
    main(tyro.cli(Plot))
