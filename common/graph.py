"""A learner's whole iteration as one graph: captured once, then replayed once per iteration.

On CUDA this is a torch.cuda.CUDAGraph: every kernel of the iteration (forward, backward,
optimizer steps, all-reduces over NCCL, what it logs) launched by one call instead of
thousands from Python. A graph replays its kernels on the memory they used at capture, so:
- the iteration's inputs are copied into the graph's own tensors before each replay;
- every tensor the iteration holds (parameters, buffers, optimizer moments) must stay the
  same tensor: one replaced since the capture (an optimizer's load_state_dict, as a resume
  does) would go on being read and written in its old place, so a new capture follows;
- warm-up iterations run first (they create the optimizers' moments, which must not be
  created inside the graph) and are then undone;
- Python runs only at capture: a value the host reads there, a branch taken, a counter
  kept in Python is fixed into the graph (the caller keys graphs by what it varies, as the
  actor's turn every policy_frequency updates, and counts the updates of a replay itself).

On a CPU, StandIn records the aten ops of one iteration with the very tensors they read and
write, and replays them on those tensors: the same contract, so a test on a CPU catches what
would go wrong on a GPU (a batch not copied in, a stale capture, warm-ups not undone). It
replays eager kernels one by one and is slower than eager: it is for tests.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common.checkpoints import optimizers


def held_tensors(obj, names: tuple[str, ...], moments: bool = True) -> list[torch.Tensor]:
    """The tensors of `obj`'s attributes `names`, in their order: a module's parameters and
    buffers, an optimizer's state (its moments; not with moments=False), a tensor itself."""
    out = []
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, torch.optim.Optimizer):
            if moments:
                out += [t for s in v.state.values() for t in s.values() if torch.is_tensor(t)]
        elif isinstance(v, torch.nn.Module):
            out += [*v.parameters(), *v.buffers()]
        elif torch.is_tensor(v):
            out.append(v)
    return out


class StandIn(TorchDispatchMode):
    """A CPU stand-in for torch.cuda.CUDAGraph: `with graph:` records the aten ops run
    inside with their arguments and results; `replay()` runs them again on the same tensors,
    writing each result that was a new tensor into the one recorded (as a graph's kernels
    write the same memory). A collective's work (gloo) is waited for at once."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            views = any(r.alias_info is not None for r in func._schema.returns)
            for old, new in zip(tree_leaves(out), tree_leaves(func(*args, **kwargs))):
                if isinstance(new, torch.ScriptObject) and hasattr(new, "wait"):
                    new.wait()
                elif torch.is_tensor(old) and not views and old is not new:
                    old.copy_(new)


class IterationGraph:
    """`fn(inputs) -> dict of tensors`, captured per key on its first call (after `warmup`
    runs, undone) and replayed on every later call with the same key; captured anew, every
    key, once a tensor of `obj`'s attributes `names` (held_tensors) is no longer the one the
    graphs hold. On CUDA a CUDA graph (its optimizers made capturable), elsewhere a StandIn.
    A failed capture raises; the caller goes on eager."""

    def __init__(self, fn, obj, names: tuple[str, ...], device: torch.device, warmup: int = 3):
        self.fn, self.device, self.warmup = fn, device, warmup
        self.held = lambda: held_tensors(obj, names)
        self.optimizers = optimizers(obj, names)
        self.graphs, self.holds = {}, None

    def __call__(self, key, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        holds = [t.data_ptr() for t in self.held()]
        if holds != self.holds:  # (a tensor replaced since the capture: capture anew)
            self.graphs.clear()
        if key not in self.graphs:
            self.graphs[key] = self.capture(batch)
            self.holds = [t.data_ptr() for t in self.held()]
        graph, inputs, outputs = self.graphs[key]
        for name, t in inputs.items():  # (into the graph's own input tensors)
            t.copy_(batch[name], non_blocking=True)
        graph.replay()
        return outputs

    def capture(self, batch: dict[str, torch.Tensor]):
        inputs = {k: v.to(self.device, copy=True) for k, v in batch.items()}
        before = self.held()
        saved = [t.detach().clone() for t in before]
        cuda = self.device.type == "cuda"
        for group in (g for opt in self.optimizers for g in opt.param_groups) if cuda else ():
            group["capturable"] = True  # (their step counts stay on the device)
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)  # (a cast cached at capture would be stale)
        try:
            # (the warm-ups, and StandIn's recording, draw no random numbers of the run's)
            with torch.random.fork_rng([self.device] if cuda else []):
                side = torch.cuda.Stream(self.device) if cuda else None
                if cuda:
                    side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                    for _ in range(self.warmup):
                        self.fn(inputs)
                if cuda:
                    torch.cuda.current_stream(self.device).wait_stream(side)
                else:
                    graph = StandIn()
                    with graph:  # (recording runs the iteration once: undone below)
                        outputs = self.fn(inputs)
            if cuda:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outputs = self.fn(inputs)
        finally:
            torch.set_autocast_cache_enabled(cache)
            with torch.no_grad():  # undo the warm-ups, in place (the graph holds these)
                known = {id(t) for t in before}
                for t, s in zip(before, saved):
                    t.copy_(s)
                for t in self.held():  # (made by a warm-up: an optimizer's moments, which
                    if id(t) not in known:  # an optimizer starts at zero)
                        t.zero_()
        return graph, inputs, outputs
