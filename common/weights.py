"""WeightSync: versioned module state in shared memory, two slots, seqlock-protected.

Version v is written to slot v % 2, so the previous version stays readable while the next
one is written: a writer never waits for readers, and a reader that asks for version v gets
exactly v (or is told it is not there yet). Each slot carries a sequence number that is odd
while the slot is being written; a reader that sees it change during its copy retries, so it
never returns a half-written state.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from common.shm import SharedArrays


def _specs(numel: int) -> dict:
    return {
        "seq": ((2,), np.int64),
        "version": ((2,), np.int64),
        "latest": ((1,), np.int64),
        "slots": ((2, numel), np.float64),
    }


class WeightSync:
    """Publish a module's state_dict (parameters and buffers) to other processes."""

    def __init__(self, arrays: SharedArrays, spec: dict):
        self.mem, self.spec = arrays, spec
        self.layout = [(k, tuple(s)) for k, s in spec["layout"]]
        self.seq, self.version = arrays["seq"], arrays["version"]
        self.latest, self.slots = arrays["latest"], arrays["slots"]

    @classmethod
    def create(cls, module: torch.nn.Module, prefix: str = "fastrl") -> WeightSync:
        """Allocate slots sized for `module`'s state_dict; nothing is published yet."""
        layout = [(k, tuple(v.shape)) for k, v in module.state_dict().items()]
        numel = sum(int(np.prod(s)) for _, s in layout)
        arrays = SharedArrays.create(_specs(numel), prefix=f"{prefix}_weights")
        arrays["version"][:] = -1
        arrays["latest"][0] = -1
        return cls(arrays, {"name": arrays.name, "numel": numel, "layout": layout})

    @classmethod
    def attach(cls, spec: dict, untrack: bool = False) -> WeightSync:
        """Map the slots described by `spec` (the creator's `.spec`)."""
        return cls(SharedArrays.attach(spec["name"], _specs(spec["numel"]), untrack), spec)

    def publish(self, module: torch.nn.Module, version: int) -> None:
        """Write `module`'s state as `version` (versions must increase by one each time)."""
        # flattened where the module lives, then one copy to the host: on a GPU that is one
        # wait for the queued training (which the weights need anyway), not one per tensor
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64)
                          for t in module.state_dict().values()]).cpu()
        slot = version % 2
        self.seq[slot] += 1  # odd: slot is being written
        self.slots[slot] = flat.numpy()
        self.version[slot] = version
        self.seq[slot] += 1  # even: slot is consistent again
        self.latest[0] = version

    def read(self, version: int | None = None) -> tuple[int, np.ndarray] | None:
        """Copy out `version` (default: the newest). None if it is not published yet.

        Raises LookupError if the requested version was already overwritten (the caller
        fell more than one version behind, which the sync schedules never do).
        """
        while True:
            want = int(self.latest[0]) if version is None else version
            if want < 0:
                return None
            slot = want % 2
            before = int(self.seq[slot])
            if before % 2:
                time.sleep(0)  # writer is mid-copy of this slot
                continue
            have = int(self.version[slot])
            data = self.slots[slot].copy()
            if int(self.seq[slot]) != before:
                continue
            if have == want:
                return want, data
            if version is None:
                continue  # the writer moved on while we looked: take the newest again
            if have < want:
                return None
            raise LookupError(f"weights version {want} was overwritten by {have}")

    def load_into(self, module: torch.nn.Module, flat: np.ndarray) -> None:
        """Copy a flat state (from `read`) into `module`'s parameters and buffers."""
        state, pos = module.state_dict(), 0
        with torch.no_grad():
            for key, shape in self.layout:
                n = int(np.prod(shape))
                state[key].copy_(torch.from_numpy(flat[pos:pos + n]).reshape(shape))
                pos += n

    def close(self) -> None:
        """Unmap in this process."""
        self.seq = self.version = self.latest = self.slots = None
        self.mem.close()

    def unlink(self) -> None:
        """Remove the segment (creator only)."""
        self.mem.unlink()
