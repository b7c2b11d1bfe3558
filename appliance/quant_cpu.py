"""Fused CPU kernels for quantizing on load: one pass per value, in numba (compiled once, cached).

The WeightStore quantizes every linear weight of a model as it loads it. quant.py's PyTorch
functions make ~10 passes over each value (convert, abs, amax, divide, bin, two lookups, pack);
these kernels read each value once: bf16 bits widened to fp32, the absmax of a row (int8) or of a
64-value block (nf4), the division, the code and the packing, on a small chunk that stays in the
cache. The arithmetic is the definition's, in fp32, operation for operation (tests compare them
bit for bit with quant.py and with the direct definition), so the codes are the same.

The absmax is taken on the integer bits: for IEEE floats |x| orders as its bits with the sign
cleared, and an integer max vectorizes where a float max (NaN rules) does not. A non-finite
value (the max reaches the exponent of inf) is refused by name, as quant.py refuses it.

Without numba (e.g. a GPU image that lacks it) this module does not import and quant.py uses its
PyTorch functions; they give the same codes, more slowly. quant.py imports it on first use, so
importing the engine does not import numba.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_NONFINITE = 0x7F800000  # fp32 bits of +inf: an |x| with bits at or above it is inf or NaN
_ROUNDER = np.float32(12582912.0)  # 1.5 · 2^23
_CHUNK = 4096  # values widened to fp32 at a time (16 KiB: in L1/L2)


def _jit(fn):
    # cache: compiled once per machine (~2 s), then loaded from __pycache__ or numba's user cache;
    # nogil: the WeightStore's reader threads quantize blocks in parallel
    return numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")(fn)


# The loops index slices from 0 (`v = y[lo:hi]; v[i]`): indexing `y[lo + i]` leaves numba's
# negative-index wrap-around in the loop, which keeps LLVM from vectorizing it (6x slower).


@_jit
def _widen(src, yi):
    """yi[:] = the fp32 bits of src (bf16 bits as uint16, or fp32 bits as uint32)."""
    if src.itemsize == 2:  # bf16: its bits are the high half of the fp32's
        for i in range(src.size):
            yi[i] = np.uint32(src[i]) << 16
    else:
        for i in range(src.size):
            yi[i] = src[i]


@_jit
def _absmax_bits(yi):
    m = np.uint32(0)
    for i in range(yi.size):
        m = max(m, yi[i] & np.uint32(0x7FFFFFFF))
    return m


@_jit
def _divide(y, d):
    for i in range(y.size):
        y[i] = y[i] / d


@_jit
def _nf4(src, thresholds, codes, absmax):
    """NF4 codes (two per byte, first value high) and per-64 absmax of src (length % 64 == 0).
    Returns -1, or the index of a block holding a non-finite value."""
    t = thresholds  # 15 fp32 thresholds: the code of y is how many are ≤ y (quant._nf4_thresholds)
    chunk_y = np.empty(_CHUNK, np.float32)
    chunk_c = np.empty(_CHUNK, np.uint8)
    m_bits = np.empty(1, np.uint32)
    m_val = m_bits.view(np.float32)
    n = src.shape[0]
    for s in range(0, n, _CHUNK):
        size = min(_CHUNK, n - s)
        y, c = chunk_y[:size], chunk_c[:size]
        yi = y.view(np.uint32)
        out = codes[s // 2 : (s + size) // 2]
        _widen(src[s : s + size], yi)
        for b in range(size // 64):
            m_bits[0] = _absmax_bits(yi[b * 64 : b * 64 + 64])
            if m_bits[0] >= _NONFINITE:
                return s // 64 + b
            m = m_val[0]
            absmax[s // 64 + b] = m
            _divide(y[b * 64 : b * 64 + 64], m if m != 0 else np.float32(1.0))  # zero block: 0/1
        for i in range(size):
            v = y[i]
            c[i] = (
                (t[0] <= v) + (t[1] <= v) + (t[2] <= v) + (t[3] <= v) + (t[4] <= v)
                + (t[5] <= v) + (t[6] <= v) + (t[7] <= v) + (t[8] <= v) + (t[9] <= v)
                + (t[10] <= v) + (t[11] <= v) + (t[12] <= v) + (t[13] <= v) + (t[14] <= v)
            )  # fmt: skip
        for i in range(size // 2):
            out[i] = (c[2 * i] << 4) | c[2 * i + 1]
    return -1


@_jit
def _int8(src, rows, cols, codes, scales):
    """int8 codes and per-row scales of src viewed as (rows, cols). Returns -1, or the index of a
    row holding a non-finite value."""
    y = np.empty(cols, np.float32)
    yi = y.view(np.uint32)
    m_bits = np.empty(1, np.uint32)
    m_val = m_bits.view(np.float32)
    for r in range(rows):
        _widen(src[r * cols : (r + 1) * cols], yi)
        m_bits[0] = _absmax_bits(yi)
        if m_bits[0] >= _NONFINITE:
            return r
        s = m_val[0] / np.float32(127)  # max|w_row| / 127
        scales[r] = s
        _divide(y, s if s != 0 else np.float32(1.0))  # a zero row: 0 / 1, all zeros
        out = codes[r * cols : (r + 1) * cols]
        for i in range(cols):
            # round half to even, as torch.round: adding and taking away 1.5·2^23 leaves an fp32
            # of |v| < 2^22 rounded to an integer by the FPU's own mode (nearest, ties to even)
            q = np.int32((y[i] + _ROUNDER) - _ROUNDER)
            out[i] = min(max(q, -127), 127)
    return -1


def _source(w: torch.Tensor) -> np.ndarray:
    """The bits the kernels read, 1-D: bf16 as uint16, fp32 as uint32; other floats converted to
    fp32 first (a copy; checkpoints are bf16 or fp32 almost always)."""
    flat = w.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.to(torch.float32).view(torch.int32).numpy().view(np.uint32)


def quantize_nf4(
    w: torch.Tensor,
    thresholds: torch.Tensor,
    codes: torch.Tensor | None = None,
    absmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes, absmax, bad block or -1) as quant.quantize_nf4 defines them; written into
    `codes` (uint8, (blocks·32,)) and `absmax` (fp32, (blocks,)) when given."""
    src = _source(w)
    pad = -src.size % 64
    if pad:  # the last block zero-padded (a copy; real weights are whole blocks)
        src = np.concatenate([src, np.zeros(pad, src.dtype)])
    if codes is None or absmax is None:
        codes = torch.empty(src.size // 2, dtype=torch.uint8)
        absmax = torch.empty(src.size // 64, dtype=torch.float32)
    bad = _nf4(src, thresholds.numpy(), _flat(codes, src.size // 2), _flat(absmax, src.size // 64))
    return codes, absmax, int(bad)


def quantize_int8(
    w: torch.Tensor, codes: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes (out, in), scales (out,), bad row or -1) as quant.quantize_int8 defines them;
    written into `codes` (int8, (out, in)) and `scales` (fp32, (out,)) when given."""
    rows, cols = w.shape
    if codes is None or scales is None:
        codes = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.float32)
    bad = _int8(_source(w), rows, cols, _flat(codes, rows * cols), _flat(scales, rows))
    return codes, scales, int(bad)


def _flat(t: torch.Tensor, n: int) -> np.ndarray:
    """A contiguous CPU tensor of n values as the 1-D array the kernels write (same memory)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"an output of {n} contiguous CPU values, got {tuple(t.shape)}")
    return t.view(-1).numpy()
