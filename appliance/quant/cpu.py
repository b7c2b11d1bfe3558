"""Fused CPU kernels for quantizing on load: one pass per value, in C (appliance/quant/_quantize.c).

The WeightStore quantizes every linear weight of a model as it loads it. reference.py's PyTorch
functions make ~10 passes over each value (convert, abs, amax, divide, bin, two lookups, pack);
these kernels read each value once: bf16 bits widened to fp32, the absmax of a row (int8) or of a
64-value block (nf4), the division, the code and the packing, on a small chunk that stays in the
cache. The arithmetic is the definition's, in fp32, operation for operation (tests compare them
bit for bit with reference.py and with the direct definition), so the codes are the same. The kernels
release the GIL, so the store's reader threads quantize side by side.

The extension is compiled when the package is installed (setup.py; optional). Where it was not
built (no C compiler at install, or a source tree used without installing it, as on a bare GPU
image) this module does not import, and reference.py quantizes with its PyTorch functions: the same
codes, ~5x slower. `appliance doctor` says which one a machine has.
"""

from __future__ import annotations

import numpy as np
import torch

import appliance.quant._quantize as _quantize


def isa() -> str:
    """The instruction set the kernels run with here (the widest of their builds the CPU has)."""
    return _quantize.isa()


def paths() -> list[str]:
    """The ways the NF4 kernel can find codes on this CPU, fastest first: a table lookup with
    AVX-512 (x86-64-v4) or AVX2 (x86-64-v3), or the count of thresholds (any CPU)."""
    return _quantize.paths()


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
    path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes, absmax, bad block or -1) as quant.quantize_nf4 defines them; written into
    `codes` (uint8, (blocks·32,)) and `absmax` (fp32, (blocks,)) when given. `path`: how the
    codes are found, one of paths() (default: the fastest here; tests run each)."""
    src = _source(w)
    pad = -src.size % 64
    if pad:  # the last block zero-padded (a copy; real weights are whole blocks)
        src = np.concatenate([src, np.zeros(pad, src.dtype)])
    if codes is None or absmax is None:
        codes = torch.empty(src.size // 2, dtype=torch.uint8)
        absmax = torch.empty(src.size // 64, dtype=torch.float32)
    thresholds = thresholds.to(torch.float32).contiguous().numpy()
    bad = _quantize.nf4(
        src,
        src.itemsize,
        thresholds,
        _flat(codes, src.size // 2),
        _flat(absmax, src.size // 64),
        path,
    )
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
    src = _source(w)
    bad = _quantize.int8(
        src, src.itemsize, rows, cols, _flat(codes, rows * cols), _flat(scales, rows)
    )
    return codes, scales, int(bad)


def _flat(t: torch.Tensor, n: int) -> np.ndarray:
    """A contiguous CPU tensor of n values as the 1-D array the kernels write (same memory)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"an output of {n} contiguous CPU values, got {tuple(t.shape)}")
    return t.view(-1).numpy()
