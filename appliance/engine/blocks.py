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

from appliance import quant
from appliance.models import hf_checkpoint
from appliance.models.layers import ModelArgs
from appliance.quant import QuantizedTensor

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
    def from_hf(
        cls, model_dir: str | Path, dtype: torch.dtype, base_quant: str = "none"
    ) -> DictBlockSource:
        """Read a HF model; with `base_quant` the linear weights are quantized from fp32."""
        args = hf_checkpoint.read_model_args(model_dir)
        ckpt = hf_checkpoint.SafetensorsCheckpoint(model_dir)
        g = hf_checkpoint.read_globals(ckpt, args, dtype)
        blocks = []
        for i in range(args.num_layers):
            if base_quant == "none":
                blocks.append(hf_checkpoint.read_block(ckpt, args, i, dtype))
                continue
            w = hf_checkpoint.read_block(ckpt, args, i, None)  # as stored: each kind converts
            w = {k: v if quant.is_linear_weight(k) else v.to(dtype) for k, v in w.items()}
            blocks.append(quant.quantize_block(w, base_quant, f"model.layers.{i}."))
        return cls(args, g, blocks)


# ---------------------------------------------------------------- flat buffers

# name → (byte offset, shape, dtype name); offsets are 64-byte aligned for fast copies. A
# quantized weight is one entry whose dtype name is its kind ("int8", "nf4") and whose shape is
# the weight's: codes, then fp32 scales at the next 64-byte boundary (quant.entry_layout).
FlatIndex = dict[str, tuple[int, tuple[int, ...], str]]


def entry_nbytes(shape: tuple[int, ...], dtype_name: str) -> int:
    """Bytes one index entry spans, padded to 64 (a plain tensor or a quantized weight)."""
    if dtype_name in quant.KINDS:
        return quant.quantized_nbytes(shape, dtype_name)
    return quant.quantized_nbytes(shape, "none", _DTYPES[dtype_name])


def layout(entries: dict[str, tuple[tuple[int, ...], str]]) -> tuple[FlatIndex, int]:
    """The index of a flat buffer holding `entries` (name → (shape, dtype name)), and its size."""
    index: FlatIndex = {}
    offset = 0
    for name, (shape, dtype_name) in entries.items():
        index[name] = (offset, tuple(shape), dtype_name)
        offset += entry_nbytes(tuple(shape), dtype_name)
    return index, offset


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def write_entry(flat: torch.Tensor, off: int, t: torch.Tensor | QuantizedTensor) -> None:
    """Copy a tensor or a quantized weight into the flat uint8 buffer at byte offset `off`."""
    if isinstance(t, QuantizedTensor):
        place = quantized_view(flat, off, t.shape, t.kind)
        place.codes.copy_(t.codes.view(place.codes.shape))
        place.scales.copy_(t.scales)
    else:
        n = t.numel() * t.element_size()
        flat[off : off + n].copy_(_as_bytes(t))


def pack(tensors: dict[str, torch.Tensor | QuantizedTensor]) -> tuple[np.ndarray, FlatIndex]:
    """Pack tensors (and quantized weights) into one contiguous uint8 array plus its index."""
    index, size = layout(
        {
            name: (t.shape, t.kind if isinstance(t, QuantizedTensor) else _dtype_name(t.dtype))
            for name, t in tensors.items()
        }
    )
    buf = np.empty(size, dtype=np.uint8)
    flat = torch.from_numpy(buf)
    for name, t in tensors.items():
        write_entry(flat, index[name][0], t)
    return buf, index


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantized_view(
    flat: torch.Tensor, off: int, shape: tuple[int, ...], kind: str
) -> QuantizedTensor:
    """The quantized weight of `shape` at byte `off` of a flat uint8 buffer, as views."""
    code_bytes, scales_at, n = quant.entry_layout(shape, kind)
    codes = flat[off : off + code_bytes]
    if kind == "int8":
        codes = codes.view(torch.int8).view(shape)
    scales = flat[off + scales_at : off + scales_at + 4 * n].view(torch.float32)
    return QuantizedTensor(kind, tuple(shape), codes, scales)


def readonly_tensor(arr: np.ndarray) -> torch.Tensor:
    """torch.from_numpy of an array that may be read-only (shared memory, a mapped file), without
    torch's warning that it is not writable. The tensor must never be written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def unpack(
    buf: np.ndarray | torch.Tensor, index: FlatIndex
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Zero-copy tensor views into `buf` (which may be a read-only shared-memory array); a
    quantized weight comes back as a QuantizedTensor of views (quant.dequantize makes a tensor).

    The views must never be written: Ray's object store buffers are immutable.
    """
    flat = readonly_tensor(buf) if isinstance(buf, np.ndarray) else buf
    out = {}
    for name, (off, shape, dtype_name) in index.items():
        if dtype_name in quant.KINDS:
            out[name] = quantized_view(flat, off, shape, dtype_name)
            continue
        dtype = _DTYPES[dtype_name]
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[name] = flat[off : off + n].view(dtype).view(shape)
    return out


@dataclass
class FlatBlockSource:
    """Blocks as flat byte buffers + indexes (the WeightStore's shared-memory layout)."""

    args: ModelArgs
    global_bufs: list[np.ndarray]  # the embeddings, final norm and LM head: a buffer each
    global_index: list[FlatIndex]
    block_bufs: list[np.ndarray]
    block_index: list[FlatIndex]

    @property
    def num_blocks(self) -> int:
        return len(self.block_bufs)

    def globals(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for buf, index in zip(self.global_bufs, self.global_index, strict=True):
            out.update(unpack(buf, index))
        return out

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
