"""Fused GPU kernels for dequantizing on the device: one pass per value, in Triton.

`device_weights.DeviceWeights.get` dequantizes a quantized block's projections once per block per pass,
on the compute device. reference.py's PyTorch functions take several passes over each weight there
(codes widened to an fp32 tensor, multiplied by the scales in place, converted to the compute
dtype; NF4 adds a table lookup and a copy to drop the padding), each writing and reading back an
fp32 temporary the size of the weight. These kernels read the codes and scales once and write the
weight once, in the compute dtype.

The arithmetic is reference.py's, operation for operation, so the result is the same bit for bit
(tests/quant/test_quant_gpu.py checks it for bf16, fp16 and fp32):

    int8  fp32(code) · scale[row], in fp32, rounded to the dtype (round to nearest even)
    nf4   LEVELS[nibble] · absmax[value // 64], in fp32, rounded to the dtype; value i's code is
          the high nibble of byte i // 2 for even i, the low one for odd i; the padding of the
          last block is not written

A single fp32 multiply, then a conversion: no fused multiply-add can change a rounding.

Without Triton (CI, a CPU-only image) this module does not import and reference.py uses its PyTorch
functions; reference.py imports it on first use with codes on a CUDA device. With TRITON_INTERPRET=1
set before the import the kernels run on CPU tensors (Triton's interpreter: how the tests check
them on a machine without a GPU).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from appliance.quant.formats import NF4_BLOCK, NF4_LEVELS

_INT8_COLS = 1024  # columns per program (int8): one row's slice, its scale loaded once
_NF4_VALUES = 2048  # values per program (nf4): 32 blocks of 64, 1024 code bytes


@triton.jit
def _store(ptr, w, mask, BF16: tl.constexpr):
    """Store fp32 `w` into `ptr`'s dtype, rounded to nearest even (as torch's `.to(dtype)`)."""
    if BF16:
        # by hand, on the bits (as c10's round_to_nearest_even; w is never NaN): Triton's
        # interpreter rounds fp32 to bf16 half up, the GPU to nearest even, so this keeps the two
        # the same code and the interpreter's tests meaningful for the GPU
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptr, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, w.to(ptr.dtype.element_ty), mask=mask)  # fp16: IEEE conversion, RTNE


@triton.jit
def _int8_kernel(codes_ptr, scales_ptr, out_ptr, cols, BLOCK: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < cols
    base = row.to(tl.int64) * cols  # int64: a weight of more than 2^31 values is addressed right
    scale = tl.load(scales_ptr + row)
    code = tl.load(codes_ptr + base + col, mask=mask, other=0)
    w = code.to(tl.float32) * scale
    _store(out_ptr + base + col, w, mask, BF16)


@triton.jit
def _nf4_kernel(
    codes_ptr, absmax_ptr, levels_ptr, out_ptr, numel, BLOCK: tl.constexpr, BF16: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel  # the last block's padding has codes but no place in the output
    byte = tl.load(codes_ptr + (i >> 1), mask=mask, other=0).to(tl.int32)
    code = tl.where((i & 1) == 0, byte >> 4, byte & 15)  # the first value in the high nibble
    level = tl.load(levels_ptr + code)  # 16 fp32 values: in the cache after the first loads
    absmax = tl.load(absmax_ptr + (i >> 6), mask=mask, other=0.0)  # i // NF4_BLOCK
    w = level * absmax
    _store(out_ptr + i, w, mask, BF16)


_levels: dict[torch.device, torch.Tensor] = {}


def _nf4_levels(device: torch.device) -> torch.Tensor:
    """The 16 NF4 levels as an fp32 tensor on `device` (made once per device)."""
    if device not in _levels:
        _levels[device] = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    return _levels[device]


def _on(device: torch.device):  # type: ignore[no-untyped-def]
    """Where a kernel launches: Triton launches on the current CUDA device, whichever device the
    tensors are on, so a launch for another device's tensors makes that one current for it."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8 (out, in) · scales fp32 (out,) per row, as `dtype` (quant.dequantize_int8)."""
    rows, cols = codes.shape
    codes, scales = codes.contiguous(), scales.contiguous()
    out = torch.empty((rows, cols), dtype=dtype, device=codes.device)
    if out.numel():
        grid = (rows, triton.cdiv(cols, _INT8_COLS))
        with _on(codes.device):
            _int8_kernel[grid](
                codes, scales, out, cols, BLOCK=_INT8_COLS, BF16=dtype == torch.bfloat16
            )
    return out


def dequantize_nf4(
    codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """NF4 codes (two per byte) · absmax per 64 values, as `dtype`, shape `shape` (the padding
    dropped) (quant.dequantize_nf4)."""
    numel = math.prod(shape)
    assert codes.numel() * 2 >= numel and absmax.numel() * NF4_BLOCK >= numel
    codes, absmax = codes.contiguous(), absmax.contiguous()
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    if numel:
        grid = (triton.cdiv(numel, _NF4_VALUES),)
        levels = _nf4_levels(codes.device)
        with _on(codes.device):
            _nf4_kernel[grid](
                codes, absmax, levels, out, numel, BLOCK=_NF4_VALUES, BF16=dtype == torch.bfloat16
            )
    return out
