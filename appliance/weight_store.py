"""WeightStore: the base model, loaded once per node into Ray's shared-memory object store.

Each block becomes one flat byte buffer (blocks.pack) put into the object store; the trainer on the
same node maps the same pages (`ray.get` of a numpy array is a zero-copy read-only view), so the
model exists once in host memory however many times the trainer is restarted. The store actor
owns the objects: they live as long as it does, across trainer restarts.

A plain class: without Ray (tests, `appliance eval`) it keeps the buffers itself.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import hf_checkpoint, storage
from .blocks import FlatBlockSource, FlatIndex, dtype_from_name, pack
from .metrics import WeightStoreMetrics
from .model import ModelArgs


@dataclass
class WeightHandles:
    """What a trainer needs to map the store's buffers: object refs (with Ray) or the arrays."""

    args: ModelArgs
    dtype: str
    global_ref: Any
    global_index: FlatIndex
    block_refs: list[Any]
    block_index: list[FlatIndex]
    nbytes: int

    def source(self) -> FlatBlockSource:
        """Resolve into a block source of zero-copy views (ray.get of shared-memory objects)."""
        refs = [self.global_ref, *self.block_refs]
        if _is_ref(self.global_ref):
            import ray

            bufs = ray.get(refs)
        else:
            bufs = refs
        return FlatBlockSource(self.args, bufs[0], self.global_index, bufs[1:], self.block_index)


def _is_ref(x: Any) -> bool:
    try:
        import ray

        return isinstance(x, ray.ObjectRef)
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return False


class WeightStore:
    """Loads `model_dir` once in `dtype` and hands out handles to its flat block buffers."""

    def __init__(self, model_dir: str | Path, dtype: str = "float32"):
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.load_count = 0
        self.load_seconds = 0.0
        self._handles: WeightHandles | None = None

    def handles(self) -> WeightHandles:
        """Load on first call (block by block), then return the same handles every time."""
        if self._handles is None:
            self._handles = self._load()
        return self._handles

    def _load(self) -> WeightHandles:
        t0 = time.perf_counter()
        model_dir = storage.localize(self.model_dir)  # s3:// or a shared path, on this node
        args = hf_checkpoint.read_model_args(model_dir)
        ckpt = hf_checkpoint.SafetensorsCheckpoint(model_dir)
        dtype = dtype_from_name(self.dtype)
        put = _putter()
        # one block at a time: read (one copy), pack (second copy), put, drop both
        gbuf, gindex = pack(hf_checkpoint.read_globals(ckpt, args, dtype))
        nbytes = gbuf.nbytes
        global_ref = put(gbuf)
        del gbuf
        refs, indexes = [], []
        for i in range(args.num_layers):
            buf, index = pack(hf_checkpoint.read_block(ckpt, args, i, dtype))
            nbytes += buf.nbytes
            refs.append(put(buf))
            indexes.append(index)
            del buf
        self.load_count += 1
        WeightStoreMetrics().record(nbytes)
        self.load_seconds = time.perf_counter() - t0
        return WeightHandles(args, self.dtype, global_ref, gindex, refs, indexes, nbytes)

    def stats(self) -> dict:
        return {
            "load_count": self.load_count,
            "load_seconds": self.load_seconds,
            "nbytes": self._handles.nbytes if self._handles else 0,
            "pid": os.getpid(),
            "node_id": _node_id(),
        }


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _putter():
    import ray

    if ray.is_initialized():
        return ray.put
    return lambda arr: arr


def local_source(model_dir: str | Path, dtype: str) -> FlatBlockSource:
    """The same flat layout without Ray (for in-process runs and tests)."""
    return WeightStore(model_dir, dtype).handles().source()
