"""Quantized base weights (int8, NF4): the formats, the reference (de)quantizers, and the kernels
that run them faster — the C quantizers the weight store loads with (cpu.py, _quantize.c) and the
Triton dequantizers the engine runs on the GPU (gpu.py, imported only where Triton is).

    formats.py    kinds, NF4 levels, an entry's byte layout, which weights are quantized
    reference.py  quantize / dequantize in PyTorch (the definition) and the choice of kernel
    cpu.py        the fused C quantizers (optional: PyTorch's are used where it did not build)
    gpu.py        the fused Triton dequantizers
"""

from appliance.quant.formats import (
    ALIGN,
    KINDS,
    NF4_BLOCK,
    NF4_LEVELS,
    QuantizedTensor,
    check_quantizable,
    entry_layout,
    is_linear_weight,
    quantized_nbytes,
)
from appliance.quant.reference import (
    dequantize,
    gpu_dequantizers,
    quantize,
    quantize_block,
    round_trip,
)

__all__ = [
    "ALIGN",
    "KINDS",
    "NF4_BLOCK",
    "NF4_LEVELS",
    "QuantizedTensor",
    "check_quantizable",
    "dequantize",
    "entry_layout",
    "gpu_dequantizers",
    "is_linear_weight",
    "quantize",
    "quantize_block",
    "quantized_nbytes",
    "round_trip",
]
