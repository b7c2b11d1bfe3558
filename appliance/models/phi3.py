"""Phi-3 / Phi-4-mini: Llama's block with fused projections and partial rotary.

`qkv_proj` holds q, k and v one after the other (rows), `gate_up_proj` gate then up; LoRA
adapts the fused modules whole (targets `qkv`, `gate_up`, as PEFT names them `qkv_proj`,
`gate_up_proj`). Phi-4-mini rotates 3/4 of each head (partial_rotary_factor 0.75) with longrope
scaling; both live in the RoPE tables (rope.rope_cos_sin) and attention.rotate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.models import layers
from appliance.models.attention import self_attention

NORMS = ("input_layernorm", "post_attention_layernorm")
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
TARGETS = ("qkv", "o", "gate_up", "down")
# the Llama targets each fused module stands for: q,k,v → qkv; gate,up → gate_up
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def mlp(
    x: torch.Tensor, w: dict[str, torch.Tensor], lora: layers.LoraContext | None
) -> torch.Tensor:
    gate, up = layers.linear(x, w, "mlp.gate_up_proj", lora).chunk(2, dim=-1)  # (B·T, inter) each
    return layers.linear(up * F.silu(gate), w, "mlp.down_proj", lora)


def block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B·T, C) → (B·T, C). (transformers' resid_pdrop dropout is not applied: fine-tuning
    configs set it to 0.)"""
    eps = args.rms_norm_eps
    h = layers.rms_norm(x, w["input_layernorm.weight"], eps)
    x = x + self_attention(h, w, args, layer, cos, sin, lora, fused=True, mask=mask)
    return x + mlp(layers.rms_norm(x, w["post_attention_layernorm.weight"], eps), w, lora)
