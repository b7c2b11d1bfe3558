"""Quantized base weights, their formats: int8 (per output row) and NF4 (QLoRA's NormalFloat4,
blocks of 64), and where each lives in a block's flat buffer.

What the codes mean is defined in reference.py, which quantizes and dequantizes (and picks the C
and Triton kernels, cpu.py and gpu.py, where they load); this module holds what every one of them
and the weight store agree on: the kinds, the NF4 levels, the byte layout of an entry
(`entry_layout`: codes first, fp32 scales at the next 64-byte boundary) and which weights are
quantized (`is_linear_weight`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from appliance.errors import ModelError

KINDS = ("none", "int8", "nf4")
NF4_BLOCK = 64
ALIGN = 64  # bytes: every entry of a flat buffer (blocks.pack) starts on this boundary

# QLoRA's NormalFloat4 levels, lowest to highest (index = code)
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_ZERO = NF4_LEVELS.index(0.0)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def is_linear_weight(name: str) -> bool:
    """Whether a block tensor (name without the `model.layers.{i}.` prefix) is quantized.

    The one rule: the weight of a linear projection module, i.e. a module whose name ends in
    `_proj` (q/k/v/o_proj, gate/up/down_proj, and fused ones such as Phi-3's qkv_proj and
    gate_up_proj; a MoE block's experts, `mlp.experts.3.gate_proj`), or one of Mixtral's experts
    (`block_sparse_moe.experts.3.w1`). Norms, biases, embeddings, a MoE router and the LM head
    are not.
    """
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    mixtral_expert = leaf in ("w1", "w2", "w3") and parent.rpartition(".")[0].endswith("experts")
    return kind == "weight" and (module.endswith("_proj") or mixtral_expert)


@dataclass
class QuantizedTensor:
    """A quantized 2-D weight: `codes` and fp32 `scales` (on one device), and its shape.

    int8: codes int8 (out, in), scales (out,). nf4: codes uint8 (nblocks·32,), scales (nblocks,).
    """

    kind: str
    shape: tuple[int, ...]
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(self.kind, self.shape, self.codes.to(device), self.scales.to(device))


def _counts(shape: tuple[int, ...], kind: str) -> tuple[int, int]:
    """(code bytes, number of fp32 scales) of a weight of `shape` quantized as `kind`."""
    numel = math.prod(shape)
    if kind == "int8":
        return numel, shape[0]
    if kind == "nf4":
        blocks = -(-numel // NF4_BLOCK)
        return blocks * NF4_BLOCK // 2, blocks
    raise ValueError(f"unknown quantization {kind!r}; one of {', '.join(KINDS)}")


def entry_layout(shape: tuple[int, ...], kind: str) -> tuple[int, int, int]:
    """(code bytes, scales' byte offset within the entry, number of scales) of a flat entry."""
    code_bytes, n_scales = _counts(shape, kind)
    return code_bytes, _align(code_bytes), n_scales


def quantized_nbytes(shape: tuple[int, ...], kind: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one weight of `shape` takes in a block's flat buffer, quantized as `kind`
    ('none': stored in `dtype`), padding to the 64-byte entry boundary included. A pure function
    of the shape: the planner sizes host memory and transfers with it, before any weight is read.
    """
    if kind == "none":
        return _align(math.prod(shape) * dtype.itemsize)
    _, scales_at, n_scales = entry_layout(shape, kind)
    return _align(scales_at + 4 * n_scales)


def check_quantizable(name: str, shape: tuple[int, ...], dtype: torch.dtype | str) -> None:
    """ModelError naming the tensor if it cannot be quantized (not 2-D, empty, not floating).

    `dtype`: a torch dtype or a safetensors dtype name ('BF16', 'I8', ...), from a header."""
    if isinstance(dtype, str):
        floating = dtype in ("F64", "F32", "F16", "BF16") or dtype.startswith("F8")
    else:
        floating = dtype.is_floating_point
    if not floating:
        raise ModelError(
            f"{name}: dtype {dtype} is not floating point; --base-quant needs float weights "
            "(the checkpoint is already quantized? use --base-quant none)"
        )
    if len(shape) != 2 or 0 in shape:
        raise ModelError(
            f"{name}: shape {tuple(shape)} cannot be quantized (--base-quant needs a 2-D "
            "(out_features, in_features) weight with no empty dimension); use --base-quant none"
        )
