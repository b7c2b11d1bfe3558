"""A writable shared-memory home for the weights of a full fine-tune.

Ray's object store holds immutable objects: a LoRA run's base never changes, so the WeightStore
puts it there. A full fine-tune rewrites every weight each step, so its store puts the same flat
buffers (the same layout, blocks.layout) back to back into one file on the shared-memory file
system (/dev/shm) instead: the store creates and owns the file, loads it once, and each trainer
on the node maps it read-write (`np.memmap`), so the optimizer's updated compute-dtype weights
are what the next forward streams (on CUDA those pages are page-locked in place, as the object
store's are). The file outlives a trainer that dies: a recreated trainer maps the same pages,
and restores the checkpoint's weights into them. It goes when the store closes; a store killed
outright (SIGKILL) leaves it, and the next store on the node removes files whose owner is gone.
"""

from __future__ import annotations

import os
import uuid
import weakref
from pathlib import Path

import numpy as np

from appliance.hardware.host import SHM_DIR

PREFIX = "appliance-weights-"
ALIGN = 4096  # each buffer starts on a page: page-locking and copies like it


class WeightHome:
    """One file of `sizes` buffers (in that order, page-aligned), mapped read-write here."""

    def __init__(self, sizes: list[int], directory: str = SHM_DIR):
        remove_stale(directory)
        self.offsets, offset = [], 0
        for n in sizes:
            self.offsets.append(offset)
            offset += -(-n // ALIGN) * ALIGN
        self.sizes = list(sizes)
        self.path = str(Path(directory) / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(self.path, "wb") as f:
            f.truncate(max(offset, 1))
        self._unlink = weakref.finalize(self, _unlink, self.path)
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r+")

    def put(self, k: int, arr: np.ndarray) -> tuple[int, int]:
        """Copy buffer k into its place; its (offset, bytes): what `buffers` maps again."""
        off, n = self.offsets[k], self.sizes[k]
        self.map[off : off + n] = arr.reshape(-1)[:n]
        return off, n

    def close(self) -> None:
        """Remove the file (trainers that still map it keep their pages until they unmap)."""
        self._unlink()


def buffers(path: str, spans: list[tuple[int, int]]) -> list[np.ndarray]:
    """The buffers at `spans` ((offset, bytes) each) of the home `path`, mapped read-write."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r+")
    return [mapped[off : off + n] for off, n in spans]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove homes whose creating process is gone (a store killed outright); their paths."""
    removed = []
    for p in Path(directory).glob(f"{PREFIX}*"):
        try:
            pid = int(p.name[len(PREFIX) :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            _unlink(str(p))
            removed.append(str(p))
        except (ValueError, PermissionError):
            continue  # not ours to judge: another user's process, or not a name we made
    return removed
