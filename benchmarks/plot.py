"""Learning curves from run dirs' TensorBoard events, against env steps and wall time.

    python benchmarks/plot.py runs/HalfCheetah-v5__fast_sac__1__* runs/...td3... --out curves.png
"""

from __future__ import annotations

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


def main(p: Plot) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not p.run_dirs:
        raise SystemExit("give at least one run directory")
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run_dir in p.run_dirs:
        steps, minutes, values = load(run_dir, p.tag)
        label = os.path.basename(os.path.normpath(run_dir))
        by_step.plot(steps, values, label=label)
        by_time.plot(minutes, values, label=label)
    by_step.set_xlabel("environment steps")
    by_time.set_xlabel("wall time (minutes)")
    by_step.set_ylabel(p.tag)
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(p.out, dpi=120)
    print(f"wrote {p.out}")


if __name__ == "__main__":
    main(tyro.cli(Plot))
