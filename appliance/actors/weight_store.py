"""WeightStore: the base model, loaded once per node into Ray's shared-memory object store.

Each block becomes one flat byte buffer (blocks.layout) put into the object store, and so does
each global tensor (embeddings, final norm, LM head); the trainer on the
same node maps the same pages (`ray.get` of a numpy array is a zero-copy read-only view), so the
model exists once in host memory however many times the trainer is restarted. The store actor
owns the objects: they live as long as it does, across trainer restarts.

A plain class: without Ray (tests, `appliance eval`) it keeps the buffers itself.

Loading maps the safetensors files (their pages mapped at once, MAP_POPULATE: the page cache's
pages, no copy and no fault per page) at the offsets the file headers give. A block whose tensors
lie side by side in one file in the dtype kept is put straight from the file's pages: one copy,
into the object store. Any other buffer is assembled from the mapped tensors, converting or
quantizing (--base-quant) in the same pass, then put. A few threads each load one block at a
time, side by side. Peak memory: the store's copy of the model plus one block per thread.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from appliance import quant
from appliance.actors import weight_home
from appliance.engine.blocks import (
    FlatBlockSource,
    FlatIndex,
    dtype_from_name,
    layout,
    quantized_view,
    readonly_tensor,
)
from appliance.errors import ModelError
from appliance.metrics.recorders import WeightStoreMetrics
from appliance.models import hf_checkpoint, mxfp4
from appliance.models.hf_checkpoint import ST_DTYPES, TensorLocation, read_model_args
from appliance.models.layers import ModelArgs
from appliance.storage.localize import localize_model


@dataclass
class WeightHandles:
    """What a trainer needs to map the store's buffers: object refs (with Ray) or the arrays."""

    args: ModelArgs
    dtype: str
    global_refs: list[Any]  # one buffer per global tensor (embeddings, final norm, LM head)
    global_index: list[FlatIndex]
    block_refs: list[Any]
    block_index: list[FlatIndex]
    nbytes: int
    base_quant: str = "none"  # int8 | nf4: the blocks' linear weights are stored quantized
    # full fine-tuning: the buffers live in this writable shared-memory file (weight_home.py),
    # and each ref is an (offset, bytes) span of it
    home: str | None = None

    def source(self) -> FlatBlockSource:
        """Resolve into a block source of zero-copy views (ray.get of shared-memory objects;
        with a writable home, read-write maps of its file)."""
        refs = [*self.global_refs, *self.block_refs]
        if self.home is not None:
            bufs = weight_home.buffers(self.home, refs)
        elif _is_ref(refs[0]):
            import ray

            bufs = ray.get(refs)
        else:
            bufs = refs
        g = len(self.global_refs)
        return FlatBlockSource(self.args, bufs[:g], self.global_index, bufs[g:], self.block_index)


def _ray() -> Any:
    """The ray module, or None where it is not installed (the GPU image: the store then keeps
    its buffers in-process, as it does when Ray is not started)."""
    try:
        import ray
    except ImportError:
        return None
    return ray


def _is_ref(x: Any) -> bool:
    ray = _ray()
    return ray is not None and isinstance(x, ray.ObjectRef)


class WeightStore:
    """Loads `model_dir` once in `dtype` and hands out handles to its flat block buffers.

    `base_quant` (int8 | nf4): every block's linear projection weights are quantized on load
    (reference.py), from the checkpoint's values in fp32; everything else is kept in `dtype`.
    `read_threads`: blocks read and converted at once (default: the CPUs, at most 4)."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        base_quant: str = "none",
        read_threads: int | None = None,
        writable: bool = False,
    ):
        """`writable` (full fine-tuning): the buffers go to a writable shared-memory home
        (weight_home.py) that the trainers update, not to Ray's immutable object store."""
        if writable and base_quant != "none":
            raise ValueError("a writable store holds the weights unquantized (base_quant none)")
        self.writable = writable
        self.home: weight_home.WeightHome | None = None
        if base_quant not in quant.KINDS:
            raise ValueError(f"base_quant {base_quant!r}: one of {', '.join(quant.KINDS)}")
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.base_quant = base_quant
        self.read_threads = read_threads or max(1, min(4, os.cpu_count() or 1))
        self.load_count = 0
        self.buffers_from_file = 0  # buffers put straight from the files' pages (the last load)
        self.load_seconds = 0.0
        self._handles: WeightHandles | None = None

    def handles(self) -> WeightHandles:
        """Load on first call (block by block), then return the same handles every time."""
        if self._handles is None:
            self._handles = self._load()
        return self._handles

    def _load(self) -> WeightHandles:
        t0 = time.perf_counter()
        model_dir = localize_model(self.model_dir)  # s3:// or a shared path, on this node
        args = hf_checkpoint.read_model_args(model_dir)
        ckpt = hf_checkpoint.SafetensorsCheckpoint(model_dir)
        ckpt.check(args)  # every tensor present with its shape, from the headers
        locs = hf_checkpoint.tensor_locations(ckpt)
        # what each buffer holds, short name → full name: each global tensor on its own (so that
        # each can be put straight from the file), then block 0, 1, ...
        parts = [{n: n} for n in hf_checkpoint.global_names(args)]
        g = len(parts)
        for i in range(args.num_layers):
            prefix = f"model.layers.{i}."
            parts.append({n[len(prefix) :]: n for n in hf_checkpoint.block_names(args, i)})
        plans = [self._plan(p, locs, quantize=k >= g) for k, p in enumerate(parts)]
        put = _putter()
        # With Ray, put copies into the object store: an assembled block's buffer is then free
        # for a later block (fresh memory would cost a page fault per 4 KiB, every block).
        # Without Ray the store keeps the buffers themselves. Writable: copies into the home.
        recycle = put is not _keep or self.writable

        def put_k(k: int, arr: np.ndarray) -> Any:
            """Buffer k, put: its ref (or the array kept, or its span of the home)."""
            return self.home.put(k, arr) if self.home is not None else put(arr)

        if self.writable:
            self.home = weight_home.WeightHome([p.size for p in plans])
        free: list[np.ndarray] = []  # list.append/pop are atomic: shared by the threads
        block_size = max((p.size for p in plans[g:] if p.span is None), default=0)

        def load(k: int) -> tuple[Any, FlatIndex, int]:
            """Map, assemble (if needed) and put buffer k: the copies of one buffer run in one
            thread, the threads' buffers side by side (Ray's put is one memcpy per call, in the
            calling thread: putting from one thread only made it the whole load's bottleneck)."""
            plan = plans[k]
            if plan.span is not None:  # the file's own bytes: put them as they lie
                view = _map(*plan.span, plan.size)
                return (put_k(k, view) if recycle else view.copy()), plan.index, plan.size
            out = None
            if recycle and k >= g:
                try:
                    out = free.pop()
                except IndexError:
                    out = np.empty(block_size, dtype=np.uint8)
            buf = _read_buffer(plan, out)
            ref = put_k(k, buf)
            if out is not None:
                free.append(out)
            return ref, plan.index, buf.nbytes

        # every buffer, in order, by a few threads (each holds one buffer at a time)
        with ThreadPoolExecutor(self.read_threads) as pool:
            loaded = list(pool.map(load, range(len(plans))))
        refs = [ref for ref, _, _ in loaded]
        indexes = [index for _, index, _ in loaded]
        nbytes = sum(n for _, _, n in loaded)
        self.load_count += 1
        self.buffers_from_file = sum(p.span is not None for p in plans)
        WeightStoreMetrics().record(nbytes)
        self.load_seconds = time.perf_counter() - t0
        home = self.home.path if self.home is not None else None
        return WeightHandles(
            args, self.dtype, refs[:g], indexes[:g], refs[g:], indexes[g:], nbytes, self.base_quant,
            home,
        )  # fmt: skip

    def close(self) -> None:
        """Remove a writable home (trainers that map it keep their pages until they unmap)."""
        if self.home is not None:
            self.home.close()

    def _plan(
        self, names: dict[str, str], locs: dict[str, TensorLocation], quantize: bool
    ) -> _BufferPlan:
        """How to load one buffer (its tensors' locations, its index and size); refuses, naming
        the tensor, a dtype it cannot convert or a weight it cannot quantize."""
        entries = {}
        for short, full in names.items():
            loc = locs[full]
            if loc.dtype not in ST_DTYPES and loc.dtype != "MXFP4":
                raise ModelError(
                    f"{loc.path}: {full} has dtype {loc.dtype}, which cannot be read "
                    f"(readable: {', '.join(ST_DTYPES)})"
                )
            if quantize and self.base_quant != "none" and quant.is_linear_weight(short):
                quant.check_quantizable(full, loc.shape, loc.dtype)
                entries[short] = (loc.shape, self.base_quant)
            else:
                entries[short] = (loc.shape, self.dtype)
        sources = {s: locs[f] for s, f in names.items()}
        if _kept_as_stored(sources, entries, self.dtype):
            # laid out in the file's order, the buffer may be the file's range as it lies
            in_file_order = dict(sorted(entries.items(), key=lambda e: sources[e[0]].offset))
            index, size = layout(in_file_order)
            span = _file_span(sources, index, size)
            if span is not None:
                return _BufferPlan(sources, index, size, self.dtype, span, names)
        index, size = layout(entries)
        return _BufferPlan(sources, index, size, self.dtype, None, names)

    def first_non_finite(self) -> str | None:
        """The checkpoint's name of the first weight that holds inf or NaN, or None when every
        one is finite: asked when a step's loss is not finite, to say which (it reads every
        weight, in this node's shared memory: seconds per GB, and only then)."""
        source = self.handles().source()
        parts = [("", source.globals())]
        parts += [(f"model.layers.{i}.", source.block(i)) for i in range(source.num_blocks)]
        for prefix, tensors in parts:
            for name, t in tensors.items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return prefix + name
        return None

    def stats(self) -> dict:
        return {
            "load_count": self.load_count,
            "load_seconds": self.load_seconds,
            "buffers_from_file": self.buffers_from_file,
            "nbytes": self._handles.nbytes if self._handles else 0,
            "base_quant": self.base_quant,
            "pid": os.getpid(),
            "node_id": _node_id(),
        }


def _node_id() -> str | None:
    ray = _ray()
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


@dataclass
class _BufferPlan:
    """One buffer of the store: where its tensors lie, its layout, and, when the buffer is a
    range of one file as it lies (`span`: that file and the range's first byte), that range."""

    locs: dict[str, TensorLocation]  # short name → where its bytes are
    index: FlatIndex
    size: int
    dtype: str  # the dtype kept (quantized entries say their kind in the index)
    span: tuple[Path, int] | None
    names: dict[str, str]  # short name → the checkpoint's, for errors


def _kept_as_stored(
    locs: dict[str, TensorLocation], entries: dict[str, tuple[tuple[int, ...], str]], dtype: str
) -> bool:
    """Whether every tensor is kept in the dtype the file stores it in (none quantized)."""
    keep = dtype_from_name(dtype)
    return all(
        kind == dtype and ST_DTYPES.get(locs[n].dtype) == keep for n, (_, kind) in entries.items()
    )


def _file_span(
    locs: dict[str, TensorLocation], index: FlatIndex, size: int
) -> tuple[Path, int] | None:
    """(file, first byte) when the buffer laid out by `index` is byte for byte one range of one
    file (every tensor where the layout puts it, nothing between them, none padded); else None."""
    if not locs or len({loc.path for loc in locs.values()}) > 1:
        return None
    start = min(loc.offset for loc in locs.values())
    if max(loc.offset + loc.nbytes for loc in locs.values()) - start != size:
        return None
    if any(index[n][0] != loc.offset - start for n, loc in locs.items()):
        return None
    return next(iter(locs.values())).path, start


def _read_buffer(plan: _BufferPlan, out: np.ndarray | None = None) -> np.ndarray:
    """Assemble one buffer from its mapped tensors, laid out by its index (into the first
    `size` bytes of `out`, else a new array): a tensor stored as it is kept is copied into its
    place; another is converted (or quantized, from fp32; or dequantized, MXFP4) into its
    place."""
    buf = np.empty(plan.size, dtype=np.uint8) if out is None else out[: plan.size]
    flat = torch.from_numpy(buf)
    dtype = dtype_from_name(plan.dtype)
    for short, loc in plan.locs.items():
        off, shape, kind = plan.index[short]
        raw = _map(loc.path, loc.offset, loc.nbytes)
        if loc.scales is not None:  # MXFP4 (gpt-oss's experts): dequantized into its place
            s = loc.scales
            scales = readonly_tensor(_map(s.path, s.offset, s.nbytes)).view(s.shape)
            n = math.prod(shape) * dtype.itemsize
            dest = flat[off : off + n].view(dtype).view(shape)
            mxfp4.dequantize(readonly_tensor(raw).view((*s.shape, -1)), scales, dtype, dest)
            continue
        src = ST_DTYPES[loc.dtype]
        if kind == plan.dtype and src == dtype:
            np.copyto(buf[off : off + loc.nbytes], raw)
            continue
        t = readonly_tensor(raw).view(src).view(shape)
        if kind in quant.KINDS:  # coded straight into its place
            name = plan.names[short]  # (an error names model.layers.1.mlp..., not mlp...)
            quant.quantize(t, kind, name, out=quantized_view(flat, off, shape, kind))
        else:
            n = t.numel() * dtype.itemsize
            flat[off : off + n].view(dtype).copy_(t.reshape(-1))
    return buf


# Map a file's pages at once (Linux): a mapping's first read of each 4 KiB page would otherwise
# trap, which costs as much as copying the page out with a read.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _map(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """The file's bytes [offset, offset + nbytes) as a read-only uint8 array over its pages (no
    copy), unmapped when the array is freed. (Read-only: a private writable mapping would be
    populated by copying every page.)"""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(
                f.fileno(),
                offset + nbytes - start,
                flags=mmap.MAP_SHARED | _POPULATE,
                prot=mmap.PROT_READ,
                offset=start,
            )
        except ValueError as e:  # the range runs past the end of the file
            raise ModelError(
                f"{path}: the file ends before byte {offset + nbytes} its header promises "
                f"({e}); the file is truncated: download it again"
            ) from None
    return np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=offset - start)


def _keep(arr: np.ndarray) -> np.ndarray:
    return arr


def _putter():
    """ray.put when Ray is up (a copy into the object store), else keep the array itself
    (also where Ray is not installed: `appliance eval` and the benches on a bare GPU image)."""
    ray = _ray()
    return ray.put if ray is not None and ray.is_initialized() else _keep


def store_nbytes(args: ModelArgs, dtype: str, base_quant: str = "none") -> int:
    """Bytes the WeightStore holds for a model of `args` (embeddings included), from the shapes
    alone: what loading it would put into the object store (tests check the two agree)."""
    total = 0
    names = [hf_checkpoint.global_names(args)]  # (stored one buffer per tensor: the same bytes)
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


def weight_store_bytes(model_dir: str | Path, dtype: str, base_quant: str = "none") -> int:
    """Bytes the base model's weight store takes in the object store: every tensor the model reads
    (config.json's shapes), in the compute dtype or quantized (store_nbytes). Reads
    config.json only."""
    return store_nbytes(read_model_args(model_dir), dtype, base_quant)
