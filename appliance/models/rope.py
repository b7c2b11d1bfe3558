"""RoPE's tables: the inverse frequencies each `rope_scaling` gives (llama3, linear, longrope,
YaRN, Gemma 4's proportional), the scale of cos and sin, and the cos/sin tables the blocks take
(whole, or gathered per row for packed documents). layers.apply_rope rotates a head with them.
"""

from __future__ import annotations

import math

import torch

from appliance.models.layers import ModelArgs


def rope_inv_freq(args: ModelArgs, seq_len: int = 0, local: bool = False) -> torch.Tensor:
    """Inverse frequencies (rot/2,), fp32, rot = the rotated dimensions of a head; scaled as
    `rope_scaling` says (llama3, linear or longrope), or the unscaled local table (Gemma 3's
    sliding layers, base `rope_local_theta`) when `local`. longrope takes its long factors when
    `seq_len` exceeds original_max_position_embeddings, as transformers does."""
    if (
        not local
        and args.rope_scaling
        and dict(args.rope_scaling).get("rope_type") == "proportional"
    ):
        return proportional_inv_freq(args)
    dim = int(args.head_dim * args.partial_rotary_factor)
    theta = args.rope_local_theta if local else args.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if args.rope_scaling is None or local:
        return 1.0 / (theta**exponents)
    p = dict(args.rope_scaling)
    kind = p.get("rope_type", "llama3")
    if kind == "linear":
        return 1.0 / (theta**exponents) / p["factor"]
    if kind == "yarn":
        return _yarn_inv_freq(p, theta, dim)
    if kind == "longrope":
        long = seq_len > p["original_max_position_embeddings"]
        ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(p: dict, theta: float, dim: int) -> torch.Tensor:
    """YaRN (gpt-oss): each frequency interpolated (divided by `factor`) or kept, by how many
    rotations it makes over the original length: a linear ramp between the dimensions that
    turn beta_fast and beta_slow times (floored and ceiled unless `truncate` is false), as
    transformers' _compute_yarn_parameters."""
    factor, old_len = p["factor"], p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast", 32.0), p.get("beta_slow", 1.0)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_attention_factor(p: dict) -> float:
    """YaRN's scale of cos and sin: `attention_factor`, else 0.1·ln(factor) + 1 (with mscale
    and mscale_all_dim: their ratio of that form)."""
    if p.get("attention_factor") is not None:
        return p["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = p["factor"]
    if p.get("mscale") and p.get("mscale_all_dim"):
        return mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
    return mscale(factor)


def proportional_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Gemma 4's full-attention RoPE ("proportional"): frequencies over the whole (global) head,
    base^(-2j/hs), for the first `partial_rotary_factor`·hs/2 pairs, zero (no rotation) for the
    others; divided by `factor`."""
    p = dict(args.rope_scaling or ())
    hs = args.global_head_dim or args.head_dim
    angles = int(p.get("partial_rotary_factor", 1.0) * hs // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / hs
    inv_freq = torch.cat((1.0 / (args.rope_theta**exponents), torch.zeros(hs // 2 - angles)))
    return inv_freq / p.get("factor", 1.0)


def rope_attention_factor(args: ModelArgs) -> float:
    """longrope's scale of cos and sin (1 otherwise): sqrt(1 + ln(factor) / ln(original length))
    unless the config gives `attention_factor`; factor defaults to max / original positions."""
    p = dict(args.rope_scaling or ())
    if p.get("rope_type") == "yarn":
        return _yarn_attention_factor(p)
    if p.get("rope_type") != "longrope":
        return 1.0
    if "attention_factor" in p:
        return p["attention_factor"]
    old_len = p["original_max_position_embeddings"]
    factor = p.get("factor", args.max_position_embeddings / old_len)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_cos_sin(
    args: ModelArgs,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    local: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (T, rot) for positions 0..T-1, computed in fp32 then cast; `local`: the
    table of Gemma 3's sliding layers (ModelArgs.local_rope). The sin table's first half is
    negated: the sign of rotate_half, made once here rather than in every block (apply_rope)."""
    inv_freq = rope_inv_freq(args, seq_len, local).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (T, rot/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, rot)
    scale = 1.0 if local else rope_attention_factor(args)
    sin = emb.sin() * scale
    sin[:, : sin.shape[-1] // 2].neg_()
    return (emb.cos() * scale).to(dtype), sin.to(dtype)


def rope_at(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row RoPE tables (B, 1, T, hs) for `positions` (B, T), gathered from (T', hs) tables:
    packed documents restart their positions at 0."""
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
