"""Llama, Mistral, Qwen2: the block of models/layers.py (pre-norm attention and SwiGLU MLP)."""

from __future__ import annotations

import torch

from appliance.models import layers

NORMS = ("input_layernorm", "post_attention_layernorm")
LINEARS = tuple(layers.TARGET_MODULES.values())  # q, k, v, o, gate, up, down
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
    return layers.block_forward(x, w, args, cos, sin, lora, mask)
