"""WeightStore: the base model, loaded once per node into Ray's shared-memory object store.

Each block becomes one flat byte buffer (blocks.pack) put into the object store; the trainer on the
same node maps the same pages (`ray.get` of a numpy array is a zero-copy read-only view), so the
model exists once in host memory however many times the trainer is restarted. The store actor
owns the objects: they live as long as it does, across trainer restarts.

A plain class: without Ray (tests, `appliance eval`) it keeps the buffers itself.

Loading reads each tensor's bytes from the safetensors files straight into its block's buffer
(at the offsets the file headers give), converting or quantizing (--base-quant) in the same pass
where the stored dtype is not the one kept; a few threads each read, convert and put one block
at a time, side by side. Peak memory: the store's copy of the model plus one block per thread.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import hf_checkpoint, quant, storage
from .blocks import FlatBlockSource, FlatIndex, dtype_from_name, layout, write_entry
from .errors import ModelError
from .hf_checkpoint import ST_DTYPES, TensorLocation
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
    base_quant: str = "none"  # int8 | nf4: the blocks' linear weights are stored quantized

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
    """Loads `model_dir` once in `dtype` and hands out handles to its flat block buffers.

    `base_quant` (int8 | nf4): every block's linear projection weights are quantized on load
    (quant.py), from the checkpoint's values in fp32; everything else is kept in `dtype`.
    `read_threads`: blocks read and converted at once (default: the CPUs, at most 4)."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        base_quant: str = "none",
        read_threads: int | None = None,
    ):
        if base_quant not in quant.KINDS:
            raise ValueError(f"base_quant {base_quant!r}: one of {', '.join(quant.KINDS)}")
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.base_quant = base_quant
        self.read_threads = read_threads or max(1, min(4, os.cpu_count() or 1))
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
        ckpt.check(args)  # every tensor present with its shape, from the headers
        locs = hf_checkpoint.tensor_locations(ckpt)
        # what each buffer holds: [globals, block 0, ...], short name → full name
        parts = [{n: n for n in hf_checkpoint.global_names(args)}]
        for i in range(args.num_layers):
            prefix = f"model.layers.{i}."
            parts.append({n[len(prefix) :]: n for n in hf_checkpoint.block_names(args, i)})
        plans = [self._plan(p, locs, quantize=k > 0) for k, p in enumerate(parts)]
        put = _putter()
        # With Ray, put copies into the object store: a block's buffer is then free for a later
        # block (fresh memory would cost a page fault per 4 KiB, every block). Without Ray the
        # store keeps the buffers themselves.
        recycle = put is not _keep
        free: list[np.ndarray] = []  # list.append/pop are atomic: shared by the threads
        block_size = max((size for _, _, size, _ in plans[1:]), default=0)

        def load(k: int) -> tuple[Any, FlatIndex, int]:
            """Read (and convert) buffer k, then put it: the two copies of one buffer run in one
            thread, the threads' buffers side by side (Ray's put is one memcpy per call, in the
            calling thread: putting from one thread only made it the whole load's bottleneck)."""
            out = None
            if recycle and k > 0:
                try:
                    out = free.pop()
                except IndexError:
                    out = np.empty(block_size, dtype=np.uint8)
            buf, index = _read_buffer(*plans[k], out)
            ref = put(buf)
            if out is not None:
                free.append(out)
            return ref, index, buf.nbytes

        # every buffer, in order, by a few threads (each holds one buffer at a time)
        with ThreadPoolExecutor(self.read_threads) as pool:
            loaded = list(pool.map(load, range(len(plans))))
        refs = [ref for ref, _, _ in loaded]
        indexes = [index for _, index, _ in loaded]
        nbytes = sum(n for _, _, n in loaded)
        self.load_count += 1
        WeightStoreMetrics().record(nbytes)
        self.load_seconds = time.perf_counter() - t0
        return WeightHandles(
            args, self.dtype, refs[0], indexes[0], refs[1:], indexes[1:], nbytes, self.base_quant
        )

    def _plan(
        self, names: dict[str, str], locs: dict[str, TensorLocation], quantize: bool
    ) -> tuple[dict[str, TensorLocation], FlatIndex, int, str]:
        """(short name → location, the buffer's index, its size, dtype) of one buffer; refuses,
        naming the tensor, a dtype it cannot convert or a weight it cannot quantize."""
        entries = {}
        for short, full in names.items():
            loc = locs[full]
            if loc.dtype not in ST_DTYPES:
                raise ModelError(
                    f"{loc.path}: {full} has dtype {loc.dtype}, which cannot be read "
                    f"(readable: {', '.join(ST_DTYPES)})"
                )
            if quantize and self.base_quant != "none" and quant.is_linear_weight(short):
                quant.check_quantizable(full, loc.shape, loc.dtype)
                entries[short] = (loc.shape, self.base_quant)
            else:
                entries[short] = (loc.shape, self.dtype)
        index, size = layout(entries)
        return {s: locs[f] for s, f in names.items()}, index, size, self.dtype

    def stats(self) -> dict:
        return {
            "load_count": self.load_count,
            "load_seconds": self.load_seconds,
            "nbytes": self._handles.nbytes if self._handles else 0,
            "base_quant": self.base_quant,
            "pid": os.getpid(),
            "node_id": _node_id(),
        }


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _read_buffer(
    locs: dict[str, TensorLocation],
    index: FlatIndex,
    size: int,
    dtype_name: str,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, FlatIndex]:
    """Read one buffer's tensors from their files into one flat array laid out by `index`
    (the first `size` bytes of `out`, else a new array).

    A tensor stored as it is kept is read straight into its place; another is read into a
    scratch array, then converted (or quantized, from fp32) into its place."""
    buf = np.empty(size, dtype=np.uint8) if out is None else out[:size]
    flat = torch.from_numpy(buf)
    dtype = dtype_from_name(dtype_name)
    files: dict[Path, int] = {}
    try:
        for short, loc in locs.items():
            fd = files.get(loc.path)
            if fd is None:
                fd = files[loc.path] = os.open(loc.path, os.O_RDONLY)
            off, shape, kind = index[short]
            src = ST_DTYPES[loc.dtype]
            if kind == dtype_name and src == dtype:
                _pread_into(fd, buf[off : off + loc.nbytes], loc)
                continue
            raw = _scratch(loc.nbytes)
            _pread_into(fd, raw, loc)
            t = torch.from_numpy(raw).view(src).view(shape)
            if kind in quant.KINDS:
                write_entry(flat, off, quant.quantize(t, kind, short))
            else:
                n = t.numel() * dtype.itemsize
                flat[off : off + n].view(dtype).copy_(t.reshape(-1))
    finally:
        for fd in files.values():
            os.close(fd)
    return buf, index


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable read buffer, at least `nbytes` (fresh memory faults per page)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def _pread_into(fd: int, dest: np.ndarray, loc: TensorLocation) -> None:
    """Fill `dest` with the tensor's bytes from the file (pread: threads share the fd safely)."""
    view = memoryview(dest)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], loc.offset + done)
        if n <= 0:
            raise ModelError(f"{loc.path}: unexpected end of file reading a tensor; re-download")
        done += n


def _keep(arr: np.ndarray) -> np.ndarray:
    return arr


def _putter():
    """ray.put when Ray is up (a copy into the object store), else keep the array itself."""
    import ray

    if ray.is_initialized():
        return ray.put
    return _keep


def store_nbytes(args: ModelArgs, dtype: str, base_quant: str = "none") -> int:
    """Bytes the WeightStore holds for a model of `args` (embeddings included), from the shapes
    alone: what loading it would put into the object store (tests check the two agree)."""
    total = 0
    names = [hf_checkpoint.global_names(args)]
    names += [hf_checkpoint.block_names(args, i) for i in range(args.num_layers)]
    shapes = hf_checkpoint.expected_shapes(args)
    for k, part in enumerate(names):
        entries = {}
        for full in part:
            short = full.split(".", 3)[-1] if k else full
            kind = base_quant if k and quant.is_linear_weight(short) else dtype
            entries[full] = (shapes[full], dtype if kind == "none" else kind)
        total += layout(entries)[1]
    return total


def local_source(model_dir: str | Path, dtype: str, base_quant: str = "none") -> FlatBlockSource:
    """The same flat layout without Ray (for in-process runs and tests)."""
    return WeightStore(model_dir, dtype, base_quant).handles().source()
