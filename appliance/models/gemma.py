"""Gemma 2 and Gemma 3 (text): sandwich norms, GeLU-tanh MLP, scaled embeddings.

Every RMSNorm scales by (1 + w) in fp32 (ModelArgs.norm_offset = 1), including Gemma 3's q/k
head norms; the residual stream sees norm(attention(norm(x))) and norm(mlp(norm(x))). Scores are
scaled by query_pre_attn_scalar^-1/2 (ModelArgs.attn_scale). Gemma 2 soft-caps attention scores
and the final logits (layers.attend, layers.logits); both alternate sliding-window and full layers
(ModelArgs.layer_types); Gemma 3's sliding layers take their own RoPE base (ModelArgs.local_rope).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.models import layers
from appliance.models.attention import self_attention

NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
LINEARS = tuple(layers.TARGET_MODULES.values())
TARGETS = tuple(layers.TARGET_MODULES)


def norm(
    x: torch.Tensor, w: dict[str, torch.Tensor], name: str, args: layers.ModelArgs
) -> torch.Tensor:
    return layers.rms_norm(x, w[f"{name}.weight"], args.rms_norm_eps, args.norm_offset)


def mlp(
    x: torch.Tensor, w: dict[str, torch.Tensor], lora: layers.LoraContext | None
) -> torch.Tensor:
    gate = F.gelu(layers.linear(x, w, "mlp.gate_proj", lora), approximate="tanh")
    return layers.linear(gate * layers.linear(x, w, "mlp.up_proj", lora), w, "mlp.down_proj", lora)


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
    h = self_attention(
        norm(x, w, "input_layernorm", args), w, args, layer, cos, sin, lora, mask=mask
    )
    x = x + norm(h, w, "post_attention_layernorm", args)
    h = mlp(norm(x, w, "pre_feedforward_layernorm", args), w, lora)
    return x + norm(h, w, "post_feedforward_layernorm", args)
