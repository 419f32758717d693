"""Soak: does resident memory stop growing once the replay buffer is full?

    python benchmarks/soak.py --minutes 20 --env HalfCheetah-v5 --buffer-size 100000

Runs a training job and samples, every --every seconds, the resident memory of the learner
and of the collector (anonymous and shared parts, from /proc). Prints the table, the growth
of each process's anonymous memory from the first sample after the buffer filled to the
end, and writes JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Soak:
    minutes: float = 20.0
    env: str = "HalfCheetah-v5"
    script: str = "fast_sac.py"
    buffer_size: int = 100_000
    """small, so that it is full early in the run"""
    every: float = 10.0
    """seconds between samples"""
    out: str = "benchmarks/soak.json"


def rss(pid: int) -> dict[str, int]:
    """RssAnon and RssShmem of `pid` in MiB."""
    with open(f"/proc/{pid}/status") as f:
        text = f.read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) // 1024
            for k in ("RssAnon", "RssShmem")}


def collector_of(pid: int) -> int | None:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for kid in f.read().split():
            with open(f"/proc/{kid}/cmdline") as g:
                if "spawn_main" in g.read():
                    return int(kid)
    return None


def main(s: Soak) -> None:
    run_dir = tempfile.mkdtemp(prefix="soak_")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, s.script), "--env", s.env, "--buffer-size",
         str(s.buffer_size), "--total-timesteps", "100000000", "--eval-interval", "0",
         "--log-interval", str(s.every), "--run-dir", run_dir],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    progress = {"step": 0}

    def follow():  # the run's progress lines give the env step count
        for line in proc.stdout:
            m = re.match(r"step\s+([\d,]+)", line)
            if m:
                progress["step"] = int(m.group(1).replace(",", ""))

    threading.Thread(target=follow, daemon=True).start()
    t0, rows = time.time(), []
    try:
        while time.time() - t0 < s.minutes * 60 and proc.poll() is None:
            time.sleep(s.every)
            kid = collector_of(proc.pid)
            row = {"t_min": round((time.time() - t0) / 60, 2), "env_steps": progress["step"],
                   "learner": rss(proc.pid), "collector": rss(kid) if kid else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.send_signal(2)
        proc.wait(300)
    full = [r for r in rows if r["env_steps"] >= s.buffer_size]
    result = {"soak": vars(s), "rows": rows}
    if len(full) >= 2:
        for who in ("learner", "collector"):
            a, b = full[0][who], full[-1][who]
            if a and b:
                result[f"{who}_anon_growth_mib_after_full"] = b["RssAnon"] - a["RssAnon"]
                print(f"{who}: RssAnon {a['RssAnon']} MiB when the buffer filled "
                      f"(t={full[0]['t_min']} min) -> {b['RssAnon']} MiB at "
                      f"t={full[-1]['t_min']} min")
    with open(s.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(tyro.cli(Soak))
