"""Named numpy arrays packed into one POSIX shared-memory segment.

The learner creates a segment with `SharedArrays.create(specs)`; other processes map the
same bytes with `SharedArrays.attach(name, specs)`. Every array is 64-byte aligned so that
concurrent writers of different arrays never share a cache line.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from multiprocessing import resource_tracker, shared_memory

import numpy as np

ALIGN = 64


def _layout(specs: dict[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[dict, int]:
    offsets, pos = {}, 0
    for key, (shape, dtype) in specs.items():
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offsets[key] = (pos, tuple(shape), dtype)
        pos += -(-max(nbytes, 1) // ALIGN) * ALIGN
    return offsets, pos


@contextlib.contextmanager
def replacing(path: str, mode: str = "wb"):
    """A file to write `path` through: path.tmp, renamed to `path` once written whole, and
    removed if writing stops early (an error, or a second Ctrl-C), so that neither a
    half-written `path` nor a stray .tmp is ever left."""
    try:
        with open(path + ".tmp", mode) as f:
            yield f
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + ".tmp")
        raise


def nbytes_of(specs: dict) -> int:
    """Size in bytes of the segment that `specs` ({name: (shape, dtype)}) needs."""
    return _layout(specs)[1]


def check_shm_space(nbytes: int, what: str) -> None:
    """Raise MemoryError with a fix if /dev/shm cannot hold `nbytes` more bytes."""
    if not os.path.isdir("/dev/shm"):
        return
    free = shutil.disk_usage("/dev/shm").free
    if nbytes > free:
        raise MemoryError(
            f"{what} needs {nbytes / 2**30:.2f} GiB of shared memory but /dev/shm has only "
            f"{free / 2**30:.2f} GiB free. Lower --buffer-size, or enlarge /dev/shm "
            "(docker run --shm-size=16g ..., or mount -o remount,size=16G /dev/shm)."
        )


class SharedArrays:
    """A dict-like set of numpy arrays living in one shared-memory segment.

    The creator owns the segment and must call `unlink()` once every user is done;
    `close()` only unmaps it in the calling process.
    """

    def __init__(self, shm: shared_memory.SharedMemory, specs: dict, owner: bool):
        self.shm, self.owner, self.name = shm, owner, shm.name
        offsets, _ = _layout(specs)
        self.arrays = {
            key: np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=off)
            for key, (off, shape, dtype) in offsets.items()
        }

    @classmethod
    def create(cls, specs: dict, prefix: str = "fastrl") -> SharedArrays:
        """Allocate a new zero-filled segment named `{prefix}_{random}`."""
        size = nbytes_of(specs)
        check_shm_space(size, f"Shared memory segment '{prefix}'")
        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        return cls(shm, specs, owner=True)

    @classmethod
    def attach(cls, name: str, specs: dict, untrack: bool = False) -> SharedArrays:
        """Map an existing segment by name.

        `untrack=True` is for processes that are not children of the creator (torchrun
        ranks): Python < 3.13 would otherwise unlink the segment when they exit.
        """
        shm = shared_memory.SharedMemory(name=name, create=False)
        if untrack:
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        return cls(shm, specs, owner=False)

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def close(self) -> None:
        """Unmap the segment in this process (arrays become invalid)."""
        self.arrays = {}
        try:
            self.shm.close()
        except BufferError:
            pass  # a numpy view is still alive somewhere; the mapping goes with the process

    def unlink(self) -> None:
        """Remove the segment's name from /dev/shm (idempotent)."""
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
