"""torch.distributed helpers for training under torchrun.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK) and picks NCCL when CUDA is available, gloo otherwise, so the same code runs in
CPU tests. Without torchrun it returns a single-process `DistInfo` and every helper here
becomes a no-op.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch._dynamo  # noqa: F401  (before any process group exists: see below)
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# torch._dynamo (torch.optim and torch.compile import it), imported first after a process
# group exists, keeps that group alive past destroy_process_group: its gloo threads then run
# until the interpreter exits, and tearing them down there can abort a finished rank
# (SIGABRT, "terminate called without an active exception": 1 to 3 runs in 30 of
# tests/dist_grad_check.py on a 2-core EPYC). So this module imports it first.

# the group that carries control integers (progress, stop, finite) as CPU tensors: gloo
# beside NCCL, so that agreeing on them never queues work on a GPU nor waits for one
_control_group = None


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global and per-node ranks, node index and device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    backend: str | None = None
    device: str = "cpu"

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def init(backend: str = "auto", device: str = "auto", timeout_s: float = 120.0,
         share_device: bool = False) -> DistInfo:
    """Join the process group that torchrun set up; a single process without torchrun.

    backend: "auto" (nccl with CUDA, else gloo), "nccl" or "gloo".
    device: "auto", "cuda" or "cpu"; with CUDA each local rank takes GPU `local_rank`, or
    with `share_device` GPU `local_rank % count`, so that several ranks run on one GPU (to
    test the multi-GPU code on a one-GPU machine: gloo only, which all-reduces CUDA tensors
    through host memory; NCCL refuses two ranks on one device).
    Raises RuntimeError with the command to use when the environment asks for several
    processes but was not set up by torchrun, or for NCCL with `share_device`.
    """
    if share_device and backend == "nccl":
        raise RuntimeError("--share-device puts several ranks on one GPU, which NCCL refuses "
                           "(one communicator rank per device); use --dist-backend gloo")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} asks for several processes, but this "
                "one was not started by torchrun (RANK or MASTER_ADDR is missing). Start it "
                "with: torchrun --nproc_per_node N fast_sac_multigpu.py ...")
        return DistInfo(device="cuda:0" if cuda else "cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    node_rank = int(os.environ.get("GROUP_RANK", str(rank // local_world)))
    num_nodes = int(os.environ.get("GROUP_WORLD_SIZE", str(world // local_world)))
    if backend == "auto":
        backend = "nccl" if cuda and not share_device else "gloo"
    if backend == "nccl" and not cuda:
        raise RuntimeError("--dist-backend nccl needs CUDA devices; use gloo on CPU")
    gpu = local_rank % max(1, torch.cuda.device_count()) if share_device else local_rank
    if cuda:
        if gpu >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} has no GPU: only "
                               f"{torch.cuda.device_count()} visible; lower --nproc_per_node "
                               "(or, with --dist-backend gloo, pass --share-device)")
        torch.cuda.set_device(gpu)
    dev = f"cuda:{gpu}" if cuda else "cpu"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's store outlives a restart (--max-restarts), and keys that an earlier
        # attempt left there (gloo's peer addresses, share_with_node's names) would be read
        # as if new: every attempt gets keys of its own
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"fastrl/attempt{attempt}", agent)
    # NCCL: naming the device binds this rank to its GPU at once (no guessing later, and the
    # communicator is created eagerly, so a bad setup fails here, not at the first collective)
    device_id = {"device_id": torch.device(dev)} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=store,
                            **device_id)
    global _control_group
    _control_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return DistInfo(rank, world, local_rank, local_world, node_rank, num_nodes, backend, dev)


def share_with_node(info: DistInfo, key: str, value: dict | None) -> dict:
    """Local rank 0 passes `value` (JSON-able) to the other ranks of its node.

    It travels through the torchrun store that the process group was built on, keyed by
    node, so nothing assumes how hosts are named.
    """
    if not info.distributed:
        return value
    store = dist.distributed_c10d._get_default_store()  # noqa: SLF001
    name = f"fastrl/node{info.node_rank}/{key}"
    if info.local_rank == 0:
        store.set(name, json.dumps(value))
        return value
    return json.loads(store.get(name))  # blocks until local rank 0 has set it


def broadcast_(tensors: Iterable[torch.Tensor], info: DistInfo, src: int = 0) -> None:
    """Overwrite `tensors` on every rank with rank `src`'s values (in place)."""
    if info.distributed:
        for t in tensors:
            dist.broadcast(t.data, src)


def allreduce_grads_(params: Iterable[torch.Tensor], info: DistInfo) -> None:
    """Average the gradients of `params` over all ranks with one flat all-reduce."""
    if not info.distributed:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(info.world_size)
    for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(avg)


def allreduce_sum_(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum `tensor` over all ranks in place; returns it."""
    if info.distributed:
        dist.all_reduce(tensor)
    return tensor


def barrier(info: DistInfo) -> None:
    """Wait until every rank gets here (no-op without torchrun)."""
    if info.distributed:
        dist.barrier()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank if `flag` is True on any (ranks use it to agree to stop)."""
    return allreduce_min(0 if flag else 1, info) == 0


def allreduce_min(value, info: DistInfo):
    """The smallest `value` (an int or float, or a list of them) over all ranks (ranks use
    it to agree on progress); a list is reduced element by element in one all-reduce. It
    travels as a CPU tensor over gloo (a group of its own beside NCCL), so it neither queues
    work on a GPU nor waits for one."""
    if not info.distributed:
        return value
    values = value if isinstance(value, list) else [value]
    dtype = torch.float64 if any(isinstance(v, float) for v in values) else torch.int64
    t = torch.tensor(values, dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_control_group)
    return t.tolist() if isinstance(value, list) else t[0].item()


def param_hash(modules: Iterable[torch.nn.Module]) -> str:
    """A short hash of the modules' parameters and buffers (bitwise)."""
    h = hashlib.sha256()
    for module in modules:
        for name, t in module.state_dict().items():
            h.update(name.encode())
            h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def gather_strings(value: str, info: DistInfo) -> list[str]:
    """`value` from every rank, in rank order."""
    if not info.distributed:
        return [value]
    out = [None] * info.world_size
    dist.all_gather_object(out, value)
    return out


def shutdown(info: DistInfo, healthy: bool = True) -> None:
    """Leave the process group (safe to call when none was joined).

    `healthy`: all ranks got here normally, so they wait for each other first; gloo can
    abort a process whose peer tears down its connections while it is still using them.
    """
    if info.distributed and dist.is_initialized():
        if healthy:
            dist.barrier()
        global _control_group
        _control_group = None
        dist.destroy_process_group()
