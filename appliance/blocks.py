"""Block sources: where the engine gets each transformer block's weights on the host.

A block source hands out host (CPU) tensors: `globals()` (embeddings, final norm, LM head) and
`block(i)` for i in range(num_blocks). Tests use `DictBlockSource` over tensors read in-process;
production uses `FlatBlockSource` over one flat byte buffer per block living in Ray's shared-memory
object store, viewed zero-copy (see weight_store.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from . import hf_checkpoint
from .model import ModelArgs

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class BlockSource(Protocol):
    args: ModelArgs

    @property
    def num_blocks(self) -> int: ...

    def globals(self) -> dict[str, torch.Tensor]: ...

    def block(self, i: int) -> dict[str, torch.Tensor]: ...


@dataclass
class DictBlockSource:
    """Blocks held as ordinary tensors (tests, small models, `appliance eval`)."""

    args: ModelArgs
    global_tensors: dict[str, torch.Tensor]
    blocks: list[dict[str, torch.Tensor]]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def globals(self) -> dict[str, torch.Tensor]:
        return self.global_tensors

    def block(self, i: int) -> dict[str, torch.Tensor]:
        return self.blocks[i]

    @classmethod
    def from_hf(cls, model_dir: str | Path, dtype: torch.dtype) -> DictBlockSource:
        args = hf_checkpoint.read_model_args(model_dir)
        ckpt = hf_checkpoint.SafetensorsCheckpoint(model_dir)
        g = hf_checkpoint.read_globals(ckpt, args, dtype)
        blocks = [hf_checkpoint.read_block(ckpt, args, i, dtype) for i in range(args.num_layers)]
        return cls(args, g, blocks)


# ---------------------------------------------------------------- flat buffers

# name → (byte offset, shape, dtype name); offsets are 64-byte aligned for fast copies
FlatIndex = dict[str, tuple[int, tuple[int, ...], str]]


def pack(tensors: dict[str, torch.Tensor]) -> tuple[np.ndarray, FlatIndex]:
    """Pack tensors into one contiguous uint8 array plus the index to view them again."""
    index: FlatIndex = {}
    offset = 0
    for name, t in tensors.items():
        index[name] = (offset, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        offset += -(-t.numel() * t.element_size() // 64) * 64
    buf = np.empty(offset, dtype=np.uint8)
    flat = torch.from_numpy(buf)
    for name, t in tensors.items():
        off = index[name][0]
        n = t.numel() * t.element_size()
        flat[off : off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf, index


def unpack(buf: np.ndarray | torch.Tensor, index: FlatIndex) -> dict[str, torch.Tensor]:
    """Zero-copy tensor views into `buf` (which may be a read-only shared-memory array).

    The views must never be written: Ray's object store buffers are immutable.
    """
    if isinstance(buf, np.ndarray):
        with warnings.catch_warnings():  # torch warns the array is not writable; we never write
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(buf)
    else:
        flat = buf
    out = {}
    for name, (off, shape, dtype_name) in index.items():
        dtype = _DTYPES[dtype_name]
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[name] = flat[off : off + n].view(dtype).view(shape)
    return out


@dataclass
class FlatBlockSource:
    """Blocks as flat byte buffers + indexes (the WeightStore's shared-memory layout)."""

    args: ModelArgs
    global_buf: np.ndarray
    global_index: FlatIndex
    block_bufs: list[np.ndarray]
    block_index: list[FlatIndex]

    @property
    def num_blocks(self) -> int:
        return len(self.block_bufs)

    def globals(self) -> dict[str, torch.Tensor]:
        return unpack(self.global_buf, self.global_index)

    def block(self, i: int) -> dict[str, torch.Tensor]:
        return unpack(self.block_bufs[i], self.block_index[i])

    def flat_block(self, i: int) -> tuple[np.ndarray, FlatIndex]:
        """Block i as its one flat buffer (uploaded to the GPU in a single copy)."""
        return self.block_bufs[i], self.block_index[i]


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; one of {', '.join(_DTYPES)}") from None
