"""Qwen3: Llama's block with RMSNorm over each head of q and k (`q_norm`, `k_norm`) before RoPE,
and an explicit `head_dim` (4096 hidden / 32 heads would be 128 anyway, but 0.6B has 1024/16 ≠ 128)."""

from __future__ import annotations

import torch

from appliance.models import layers
from appliance.models.attention import self_attention

NORMS = ("input_layernorm", "post_attention_layernorm")
LINEARS = tuple(layers.TARGET_MODULES.values())
TARGETS = tuple(layers.TARGET_MODULES)


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
    """(B·T, C) → (B·T, C)."""
    eps = args.rms_norm_eps
    h = layers.rms_norm(x, w["input_layernorm.weight"], eps)
    x = x + self_attention(h, w, args, layer, cos, sin, lora, mask=mask)
    return x + layers.mlp(layers.rms_norm(x, w["post_attention_layernorm.weight"], eps), w, lora)
