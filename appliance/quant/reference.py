"""Quantized base weights: int8 (per output row) and NF4 (QLoRA's NormalFloat4, blocks of 64).

The WeightStore quantizes the linear projection weights of every block when it loads them
(`is_linear_weight` says which), from the checkpoint's values converted to fp32. Norms, biases,
embeddings and the LM head stay in the compute dtype. A quantized weight is a `QuantizedTensor`:
codes plus fp32 scales, stored in the block's flat buffer as one entry (codes first, scales at the
next 64-byte boundary; `entry_layout`), so the bytes in shared memory and the bytes copied to the
device are the quantized ones. `dequantize` turns it back into the compute dtype on whatever
device its codes live on, once per block per pass (DeviceWeights.get): on a CUDA device with
Triton in one fused pass (quant/gpu.py), else with the PyTorch functions below.

Definitions (the tests check these exactly against a direct implementation):

    int8  scale = max|w_row| / 127 (fp32); q = clamp(round(w / scale), -127, 127), round half to
          even; a zero row is all zeros. Dequantized q · scale.
    nf4   w flattened row-major into blocks of 64 values (zero-padded at the end); absmax per
          block (fp32); each value coded as the index of the nearest NF4 level to w / absmax
          (ties to the lower index; a zero block codes 0.0, index 7); two codes per byte, the
          first value in the high nibble (as bitsandbytes). Dequantized level · absmax.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from appliance.errors import ModelError
from appliance.quant.formats import (
    NF4_BLOCK,
    NF4_LEVELS,
    QuantizedTensor,
    check_quantizable,
    is_linear_weight,
)

_CHUNK = 1 << 20  # values quantized at a time: fp32 temporaries of 4 MiB, near the caches


def quantize(
    w: torch.Tensor, kind: str, name: str = "weight", out: QuantizedTensor | None = None
) -> QuantizedTensor:
    """Quantize a 2-D weight (any float dtype; converted to fp32 first) as `kind`.

    On a CPU, quant/cpu.py's fused C kernels (one pass per value) where built; else the PyTorch
    functions below. Both give the same codes and scales (tests compare them bit for bit).
    `out`: where to write the codes and scales (views into a block's buffer: the fused kernels
    write there directly, with no array of their own); returned."""
    check_quantizable(name, tuple(w.shape), w.dtype)
    if kind not in ("int8", "nf4"):
        raise ValueError(f"unknown quantization {kind!r}; one of int8, nf4")
    fused = _fused_kernels() if w.device.type == "cpu" else None
    into = (out.codes, out.scales) if fused and out is not None else (None, None)
    if kind == "int8":
        codes, scales, bad = fused.quantize_int8(w, *into) if fused else quantize_int8(w)
        where = f"row {bad}"
    else:
        codes, scales, bad = (
            fused.quantize_nf4(w, NF4_THRESHOLDS, *into) if fused else quantize_nf4(w)
        )
        where = f"values {bad * NF4_BLOCK}..{(bad + 1) * NF4_BLOCK - 1} (flattened)"
    if bad >= 0:
        raise ModelError(
            f"{name}: {where} holds inf or NaN, which cannot be quantized; the checkpoint is "
            "damaged (re-download or re-export it) or use --base-quant none"
        )
    if out is None:
        return QuantizedTensor(kind, tuple(w.shape), codes, scales)
    if codes.data_ptr() != out.codes.data_ptr():  # computed elsewhere: copy into place
        out.codes.copy_(codes.view(out.codes.shape))
        out.scales.copy_(scales)
    return out


@functools.cache
def _fused_kernels():
    """quant/cpu.py (the fused C kernels), imported on first use; None where the extension was not
    built at install (then the PyTorch functions code the same values, ~5x slower)."""
    try:
        from appliance.quant import cpu as quant_cpu
    except ImportError as e:  # appliance._quantize not compiled (no C compiler at install)
        warnings.warn(
            f"--base-quant: the fused CPU quantizers are not built ({e}); quantizing with "
            "PyTorch, ~5x slower (reinstall the appliance where a C compiler is present)",
            stacklevel=2,
        )
        return None
    return quant_cpu


@functools.cache
def _gpu_kernels():
    """quant/gpu.py (Triton's fused kernels), imported on first use with codes on a CUDA device;
    None where Triton is missing or does not import (then the PyTorch functions give the same
    values, in several passes over the weight)."""
    try:
        from appliance.quant import gpu as quant_gpu

        # Triton compiles a kernel (and its launcher, with the host's C compiler) at its first
        # launch, not at import: launch both here, so that a missing compiler, an unwritable
        # cache or a GPU its ptxas does not know falls back now, not in the middle of a step
        device = _probe_device()
        if device is not None:
            _launch_each(quant_gpu, device)
    except Exception as e:  # no triton; a triton that does not match this torch or driver
        warnings.warn(
            f"--base-quant: Triton's GPU kernels unavailable ({type(e).__name__}: {e}); "
            "dequantizing with PyTorch, slower",
            stacklevel=2,
        )
        return None
    return quant_gpu


def _probe_device() -> torch.device | None:
    """Where _gpu_kernels launches the kernels once: this process's CUDA device, if any."""
    return torch.device("cuda") if torch.cuda.is_available() else None


def _launch_each(kernels, device: torch.device) -> None:  # type: ignore[no-untyped-def]
    """Dequantize a tiny weight of each kind into each dtype dequantize uses them for, with
    `kernels` on `device` (Triton compiles one kernel per output dtype), waiting for the GPU (a
    kernel's launch errors surface at the next synchronization)."""
    w = torch.linspace(-1.0, 1.0, 2 * NF4_BLOCK).view(2, NF4_BLOCK)
    q8, q4 = quantize(w, "int8", "probe").to(device), quantize(w, "nf4", "probe").to(device)
    for dtype in _GPU_DTYPES:
        kernels.dequantize_int8(q8.codes, q8.scales, dtype)
        kernels.dequantize_nf4(q4.codes, q4.scales, q4.shape, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# where dequantize uses quant/gpu.py: codes on these device types, into these dtypes (those tested)
_GPU_DEVICES = ("cuda",)  # the tests add "cpu" to run the dispatch under Triton's interpreter
_GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gpu_dequantizers(device: torch.device, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """quant/gpu.py's fused kernels where `dequantize` uses them (codes on a GPU, into a dtype they
    are tested in, Triton loaded and launched), else None: the PyTorch functions below."""
    if device.type in _GPU_DEVICES and dtype in _GPU_DTYPES:
        return _gpu_kernels()
    return None


def dequantize(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight back in `dtype`, on the codes' device (shape q.shape).

    On a CUDA device with Triton, quant/gpu.py's fused kernels (one pass: codes and scales read
    once, the weight written once in `dtype`); else the PyTorch functions below. Both give the
    same values bit for bit (tests/quant/test_quant_gpu.py)."""
    fused = gpu_dequantizers(q.codes.device, dtype)
    if q.kind == "int8":
        impl = fused.dequantize_int8 if fused else dequantize_int8
        return impl(q.codes, q.scales, dtype)
    impl = fused.dequantize_nf4 if fused else dequantize_nf4
    return impl(q.codes, q.scales, q.shape, dtype)


# ---------------------------------------------------------------- int8


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes int8 (out, in), scales fp32 (out,), the first row holding inf/NaN or -1):
    symmetric per output row."""
    codes = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.float32)
    rows = max(1, _CHUNK // max(1, w.shape[1]))
    for r in range(0, w.shape[0], rows):  # in slices of rows: fp32 temporaries stay small
        x = w[r : r + rows].to(torch.float32, copy=True)
        s = x.abs().amax(dim=1) / 127  # max|w_row| / 127
        if not torch.isfinite(s).all():  # refused by quantize, naming the row
            return codes, scales, r + int((~torch.isfinite(s)).nonzero()[0])
        scales[r : r + rows] = s
        x.div_(torch.where(s == 0, 1.0, s)[:, None])  # a zero row: 0 / 1, all zeros
        codes[r : r + rows] = x.round_().clamp_(-127, 127)  # round half to even
    return codes, scales, -1


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(torch.float32).mul_(scales[:, None]).to(dtype)


# ---------------------------------------------------------------- nf4


def _levels(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


@functools.cache
def _nf4_pairs(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32 on `device`: the two levels a byte of codes holds (high nibble first). Made
    once per device: a host tensor copied to a GPU on every call would wait for the GPU."""
    byte = torch.arange(256)
    return _levels(torch.device("cpu"))[torch.stack([byte >> 4, byte & 0xF], dim=1)].to(device)


def _nf4_thresholds() -> torch.Tensor:
    """(15,) fp32: T[j] is the smallest fp32 y for which level j+1 is strictly nearer to y than
    level j, both distances computed in fp32 as the definition does.

    The comparison is monotone in y (fp32 subtraction rounds monotonically), so the nearest
    level of any y in [-1, 1], ties to the lower, is the number of thresholds ≤ y: one
    `bucketize` codes a value exactly as an argmin over the 16 distances would."""
    levels = _levels(torch.device("cpu"))
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    out = []
    for j in range(15):
        lo, hi = levels[j], levels[j + 1]

        def upper_nearer(y: torch.Tensor, lo=lo, hi=hi) -> bool:
            return bool((hi - y).abs() < (y - lo).abs())

        y = (lo + hi) / 2
        while upper_nearer(y):
            y = torch.nextafter(y, down)
        while not upper_nearer(y):
            y = torch.nextafter(y, up)
        out.append(y)
    return torch.stack(out)


NF4_THRESHOLDS = _nf4_thresholds()
_BINS = 1 << 12  # bins per unit of y for the code tables (thresholds are ≥ 0.08 apart)


def _bin(y: torch.Tensor) -> torch.Tensor:
    """int32 bin of each y in [-1, 1]: trunc(y·S + S), monotone in y (fp32 rounding is)."""
    return torch.mul(y, _BINS).add_(_BINS).to(torch.int32)


def _nf4_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(base uint8, threshold fp32) per bin: the code of y is base[bin] + (y >= threshold[bin]).

    base[b] counts the thresholds in earlier bins (all < y, as bins are monotone); at most one
    threshold falls in bin b (its comparison is made exactly), +inf where none does. Two
    index_select passes, where a binary search per value (torch.bucketize) is ~10× slower here."""
    bins = _bin(NF4_THRESHOLDS).long()
    assert len(set(bins.tolist())) == 15  # one threshold per bin at most
    base = torch.zeros(2 * _BINS + 1, dtype=torch.uint8)
    threshold = torch.full((2 * _BINS + 1,), math.inf)
    for b, t in zip(bins.tolist(), NF4_THRESHOLDS, strict=True):
        base[b + 1 :] += 1
        threshold[b] = t
    return base, threshold


_NF4_BASE, _NF4_THRESHOLD = _nf4_tables()


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes uint8 (nblocks·32,), absmax fp32 (nblocks,), the first block holding inf/NaN or
    -1) of `w` flattened row-major."""
    flat = w.reshape(-1)
    n = flat.numel()
    blocks = -(-n // NF4_BLOCK)
    codes = torch.empty(blocks * NF4_BLOCK // 2, dtype=torch.uint8)
    absmax = torch.empty(blocks, dtype=torch.float32)
    base, threshold = _NF4_BASE.to(flat.device), _NF4_THRESHOLD.to(flat.device)
    step = _CHUNK // NF4_BLOCK * NF4_BLOCK
    for start in range(0, n, step):
        x = flat[start : start + step].to(torch.float32, copy=True)
        if x.numel() % NF4_BLOCK:  # the last block: zero-padded
            x = torch.cat([x, x.new_zeros(NF4_BLOCK - x.numel() % NF4_BLOCK)])
        x = x.view(-1, NF4_BLOCK)
        m = x.abs().amax(dim=1)  # absmax per block
        b0 = start // NF4_BLOCK
        if not torch.isfinite(m).all():  # refused by quantize, naming the block
            return codes, absmax, b0 + int((~torch.isfinite(m)).nonzero()[0])
        absmax[b0 : b0 + x.shape[0]] = m
        x.div_(torch.where(m == 0, 1.0, m)[:, None])  # a zero block: 0 / 1, all 0.0
        y = x.view(-1)
        b = _bin(y)
        code = torch.index_select(base, 0, b)
        code += torch.index_select(threshold, 0, b) <= y  # the number of thresholds ≤ y
        code = code.view(-1, 2)
        c0 = b0 * NF4_BLOCK // 2
        codes[c0 : c0 + code.shape[0]] = code[:, 0] * 16 + code[:, 1]  # first value: high nibble
    return codes, absmax, -1


def dequantize_nf4(
    codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """level · absmax, in `dtype`, shape `shape` (the padding dropped)."""
    pairs = _nf4_pairs(codes.device)  # (256, 2): a byte's two values
    w = torch.index_select(pairs, 0, codes.to(torch.int32)).view(-1, NF4_BLOCK)
    w.mul_(absmax[:, None])
    return w.view(-1)[: math.prod(shape)].view(shape).to(dtype)


def quantize_block(
    tensors: dict[str, torch.Tensor], kind: str, where: str = ""
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """A block's tensors with every linear projection weight quantized as `kind` ('none': as is).
    `where` prefixes the tensor names in errors (e.g. `model.layers.3.`)."""
    if kind == "none":
        return dict(tensors)
    return {
        name: quantize(t, kind, where + name) if is_linear_weight(name) else t
        for name, t in tensors.items()
    }


def round_trip(w: torch.Tensor, kind: str) -> torch.Tensor:
    """`w` quantized as `kind` and dequantized again (fp32): what a quantized base computes with."""
    if kind == "none":
        return w.to(torch.float32)
    return dequantize(quantize(w, kind), torch.float32)
