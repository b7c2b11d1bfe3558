"""Self-attention of the newer families (Qwen3, Gemma 2/3, Phi-3), built on models/layers.py's parts.

What it adds to Llama's `layers.attention`: a fused qkv projection (Phi-3), RMSNorm over each
head of q and k (Qwen3, Gemma 3), RoPE on only the first dimensions of a head (Phi-4-mini), and
the per-layer kernel choice of `layers.attend` (sliding window, soft-capping, softmax scale).

Shapes: B batch, T sequence, nh query heads, nkv key/value heads, hs head size, rot rotated
dimensions (hs · partial_rotary_factor).
"""

from __future__ import annotations

import torch

from appliance.models import layers


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first rot = cos.shape[-1] dimensions of each head; the rest pass unchanged.
    x (B, n, T, hs), cos/sin (T, rot)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return layers.apply_rope(x, cos, sin)
    return torch.cat((layers.apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


def project_qkv(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    lora: layers.LoraContext | None,
    T: int,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B·T, C) → q (B, nh, T, hs), k and v (B, nkv, T, hs); q and k head-normed if the model
    says so. `fused`: one `qkv_proj` whose output rows are q, then k, then v (Phi-3)."""
    nh, nkv, hs = args.num_heads, args.num_kv_heads, args.head_dim
    if fused:
        q, k, v = layers.linear(x, w, "self_attn.qkv_proj", lora).split(
            (nh * hs, nkv * hs, nkv * hs), dim=-1
        )
    else:
        q = layers.linear(x, w, "self_attn.q_proj", lora)
        k = layers.linear(x, w, "self_attn.k_proj", lora)
        v = layers.linear(x, w, "self_attn.v_proj", lora)
    q, k, v = q.view(-1, T, nh, hs), k.view(-1, T, nkv, hs), v.view(-1, T, nkv, hs)
    if args.qk_norm:
        eps, off = args.rms_norm_eps, args.norm_offset
        q = layers.rms_norm(q, w["self_attn.q_norm.weight"], eps, off)
        k = layers.rms_norm(k, w["self_attn.k_norm.weight"], eps, off)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def self_attention(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None,
    fused: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block `layer`'s attention: (B·T, C) → (B·T, C) (or 3-D: layers.heads), its window from
    ModelArgs.window; `mask`: see layers.attend (packed documents)."""
    q, k, v = project_qkv(x, w, args, lora, cos.shape[-2], fused)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    window, cap = args.window(layer), args.attn_softcap
    y = layers.attend(q, k, v, args.attn_scale, window, cap, mask)  # (B, nh, T, hs)
    return layers.linear(layers.merge_heads(y, x), w, "self_attn.o_proj", lora)
