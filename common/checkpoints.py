"""A run's checkpoint files, which carry the shared segments across a restart: each one holds
the learner's state beside the collectors' snapshots and names its replay file (a copy of
the replay buffer's rows). What a checkpoint holds is the script's choice; here is how its
files are kept: written whole or not at all, old ones removed with their replay files, and
the newest complete one found again (it loads, and its replay file is whole), and the
arguments a resumed run continues with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys

import torch

from common.collectors import ArgsError
from common.replay import ReplayBuffer
from common.shm import replacing


def save(state: dict, run_dir: str, name: str, keep: int) -> None:
    """Write `state` to run_dir/name via a temporary file and a rename (a crash never leaves
    a half-written checkpoint), then remove all but the newest `keep` checkpoint_*.pt files
    and their replay files."""
    with replacing(os.path.join(run_dir, name)) as f:
        torch.save(state, f)
    for step in steps(run_dir)[:-keep]:
        for old in (f"checkpoint_{step}.pt", f"checkpoint_{step}.replay.npz"):
            with contextlib.suppress(FileNotFoundError):  # (the .pt first: a crash never
                os.remove(os.path.join(run_dir, old))  # leaves it without its replay file)


def steps(run_dir: str) -> list[int]:
    """The env steps of the checkpoint_*.pt files in `run_dir`, oldest first."""
    names = (re.fullmatch(r"checkpoint_(\d+)\.pt", f) for f in os.listdir(run_dir))
    return sorted(int(m.group(1)) for m in names if m)


def load(path: str, script: str) -> dict:
    """The checkpoint at `path`, if `script` wrote it and its replay file (if it names one)
    is whole; else ArgsError."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ArgsError(f"cannot read checkpoint {path}: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("script") != script:
        raise ArgsError(f"{path} was not written by {script}.py "
                        f"(script: {ckpt.get('script') if isinstance(ckpt, dict) else '?'})")
    replay = ckpt["replay"] and os.path.join(os.path.dirname(path), ckpt["replay"])
    if replay and not ReplayBuffer.file_is_whole(replay):
        raise ArgsError(f"its replay file {replay} is missing or cut off")
    ckpt["path"], ckpt["dir"] = path, os.path.dirname(path)
    return ckpt


def find(path: str, script: str) -> dict:
    """The checkpoint `path`, or the newest complete one in the run dir `path` (written last,
    model_final.pt too); incomplete ones are skipped with a warning."""
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise ArgsError(f"checkpoint {path} does not exist")
        return load(path, script)
    names = [f"checkpoint_{s}.pt" for s in steps(path)] + ["model_final.pt"]
    files = [os.path.join(path, n) for n in names if os.path.exists(os.path.join(path, n))]
    for file in sorted(files, key=os.path.getmtime, reverse=True):
        try:
            return load(file, script)
        except ArgsError as e:
            print(f"warning: skipping {file}: {e}", file=sys.stderr, flush=True)
    raise ArgsError(f"no complete checkpoint_*.pt or model_final.pt in {path}")


def state_of(obj, names: tuple[str, ...]) -> dict:
    """What a checkpoint holds of `obj`'s attributes `names`: a module's or an optimizer's
    state_dict, a tensor's value (on the CPU)."""
    return {k: v.detach().cpu() if torch.is_tensor(v) else v.state_dict()
            for k in names if (v := getattr(obj, k)) is not None}


def load_into(obj, names: tuple[str, ...], state: dict) -> None:
    """Load what state_of saved into `obj`'s attributes `names` (see load_optimizer)."""
    for k in names:
        if isinstance(v := getattr(obj, k), torch.optim.Optimizer):
            load_optimizer(v, state[k])
        elif torch.is_tensor(v):
            with torch.no_grad():
                v.copy_(state[k])
        elif v is not None:
            v.load_state_dict(state[k])


def optimizers(obj, names: tuple[str, ...]) -> list[torch.optim.Optimizer]:
    """The optimizers among `obj`'s attributes `names`."""
    return [o for k in names if isinstance(o := getattr(obj, k), torch.optim.Optimizer)]


def check_fits(mine: dict, ckpt: dict) -> None:
    """Refuse, in one line, a checkpoint whose tensors do not fit the networks built now
    (`mine`: what state_of gives for them): the first tensor whose shape differs, or that
    one side lacks, whatever argument caused it. Raises ArgsError."""
    def shapes(state) -> dict[str, list[int]]:
        if torch.is_tensor(state):
            return {"": list(state.shape)}
        if not isinstance(state, dict):  # (a count)
            return {}
        if "param_groups" in state:  # an optimizer: its groups' sizes (the moments follow)
            return {f"group {i}": [len(g["params"])] for i, g in enumerate(state["param_groups"])}
        return {k: list(v.shape) for k, v in state.items() if torch.is_tensor(v)}

    for section, state in mine.items():
        here, there = shapes(state), shapes(ckpt.get(section))
        for name in [*here, *(k for k in there if k not in here)]:
            if here.get(name) != there.get(name):
                where = f"{section}.{name}".rstrip(".")
                raise ArgsError(f"{ckpt['path']} does not fit the networks built now: {where} is "
                                f"{there.get(name, 'missing')} there and "
                                f"{here.get(name, 'missing')} here; resume with the arguments "
                                "it was trained with")


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """An optimizer's saved moments, with this run's settings (learning rate, weight decay
    and betas, from the saved arguments or the flags given on resume) and this machine's
    kernel choice (fused or not)."""
    groups = [g | {k: v for k, v in mine.items() if k != "params"}
              for g, mine in zip(saved["param_groups"], optimizer.state_dict()["param_groups"])]
    optimizer.load_state_dict(saved | {"param_groups": groups})


def saved_args(args_class, ckpt: dict):
    """The arguments a checkpoint was written with (fields removed since are dropped)."""
    names = {f.name for f in dataclasses.fields(args_class)}
    return args_class(**{k: v for k, v in ckpt["args"].items() if k in names})


def resume(args, argv: list[str], script: str, fixed: tuple[str, ...],
           machine: tuple[str, ...]) -> tuple[object, dict | None]:
    """The checkpoint that --resume names (a file or a run dir; auto: --run-dir's newest
    complete one, or none for a fresh start) and the arguments to continue it with: the
    saved ones, with the fields of `machine` back at their defaults (resolved again for
    this machine), under the flags given in `argv` (tyro parses them again over the saved
    ones, so a flag given wins even where it equals its default). A flag that changes a
    field of `fixed` (the run's shapes) is refused."""
    import tyro

    auto = args.resume == "auto"
    if auto and not args.run_dir:
        raise ArgsError("--resume auto needs --run-dir: the run to continue or to start")
    try:
        ckpt = find(args.run_dir if auto else args.resume, script)
    except ArgsError as e:
        if not auto:
            raise
        if os.path.isdir(args.run_dir):
            print(f"--resume auto: starting fresh ({e})", file=sys.stderr, flush=True)
        return args, None
    saved, defaults = saved_args(type(args), ckpt), type(args)()
    here = dataclasses.replace(saved, **{k: getattr(defaults, k) for k in machine})
    merged = tyro.cli(type(args), args=argv, default=here)
    for key in fixed:
        if getattr(merged, key) != getattr(saved, key):
            raise ArgsError(f"--{key.replace('_', '-')} {getattr(merged, key)} does not match "
                            f"the checkpoint's {getattr(saved, key)}; a run continues with its "
                            "own shapes")
    # (into the run dir resumed from, or the --run-dir given now: never the saved one, which
    # is another run's when a run dir was copied)
    merged.run_dir = args.run_dir or ckpt["dir"]
    return merged, ckpt
