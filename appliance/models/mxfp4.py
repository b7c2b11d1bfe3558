"""MXFP4 weights as gpt-oss's released checkpoints store its experts: dequantized on load.

A quantized tensor `X` (say `mlp.experts.gate_up_proj`, held as (E, in, out)) is stored as two:
`X_blocks` (E, out, in/32, 16) uint8, two FP4 (E2M1) codes a byte, the low nibble first, and
`X_scales` (E, out, in/32) uint8, one power-of-two exponent (biased by 127) per 32 values along
`in`; the config.json says `quantization_config: {quant_method: mxfp4}`. Value = FP4_VALUES[code]
· 2^(scale − 127). `dequantize` is transformers' `convert_moe_packed_tensors` (the same table, the
same ldexp, the same transpose to (E, in, out)), written one expert at a time into a destination
so that a load holds one expert's codes, never a second copy of the model.
"""

from __future__ import annotations

import torch

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # values per scale (16 bytes of codes)
# E2M1 values of the 16 codes (transformers.integrations.mxfp4.FP4_VALUES)
FP4_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0
)  # fmt: skip
BITS_PER_VALUE = 4 + 8 / GROUP  # 4.25: a code, and a 1-byte scale shared by 32 values


def packed_pairs(names) -> dict[str, tuple[str, str]]:
    """name → (its `_blocks` name, its `_scales` name), for every pair among `names` (a name's
    `_blocks` and `_scales` both present: an MXFP4 tensor)."""
    names = set(names)
    return {
        n[: -len(BLOCKS)]: (n, n[: -len(BLOCKS)] + SCALES)
        for n in names
        if n.endswith(BLOCKS) and n[: -len(BLOCKS)] + SCALES in names
    }


def dequantized_shape(
    blocks: tuple[int, ...], scales: tuple[int, ...], name: str = "tensor"
) -> tuple[int, ...]:
    """The (E, in, out) shape of a tensor stored as blocks (E, out, G, 16) and scales (E, out, G);
    ValueError naming `name` for any other pair."""
    if len(blocks) != 4 or blocks[-1] != GROUP // 2 or tuple(blocks[:-1]) != tuple(scales):
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks)} and scales {tuple(scales)} are not the "
            f"released layout (E, out, in/{GROUP}, {GROUP // 2}) and (E, out, in/{GROUP})"
        )
    E, out, G, _ = blocks
    return (E, G * GROUP, out)


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """blocks (E, out, G, 16) uint8 and scales (E, out, G) uint8 → (E, G·32, out) in `dtype`,
    into `out` when given (any (E, G·32, out) tensor of that dtype), one expert at a time."""
    E, rows, G, B = blocks.shape
    if out is None:
        out = torch.empty(E, G * B * 2, rows, dtype=dtype)
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    for j in range(E):
        blk = blocks[j].to(torch.uint8).reshape(rows * G, B)
        exp = (scales[j].to(torch.int32) - 127).reshape(rows * G, 1)
        vals = torch.empty(rows * G, B * 2, dtype=dtype)
        vals[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
        vals[:, 1::2] = lut[(blk >> 4).to(torch.int)]
        torch.ldexp(vals, exp, out=vals)
        out[j].copy_(vals.reshape(rows, G * B * 2).T)
    return out
