"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biases
on q, k and v; config.json's `qkv_bias`), then a sparse MoE MLP as Qwen3-MoE's (models/
qwen3_moe.py: softmax, top k, renormalised when norm_topk_prob, each expert stored apart) plus a
shared expert beside the routed ones (moe.shared_expert), as transformers'
Qwen2MoeSparseMoeBlock computes it: routed + sigmoid(h · shared_expert_gateᵀ) · shared(h).

Dense blocks among the sparse ones (mlp_only_layers, decoder_sparse_step ≠ 1) and the sliding
window are refused by name (hf_config), as for Qwen3-MoE. LoRA: the attention by default, the
shared expert's linears as shared_gate, shared_up, shared_down, the experts with `experts`.
"""

from __future__ import annotations

import torch

from appliance.models import layers, moe, qwen3_moe
from appliance.models.attention import self_attention

MOE = True
NORMS = qwen3_moe.NORMS
LINEARS = qwen3_moe.LINEARS + moe.SHARED  # in the order a block calls them
TARGETS = ("q", "k", "v", "o", "shared_gate", "shared_up", "shared_down", "experts")
DEFAULT_TARGETS = ("q", "k", "v", "o")
LAYOUT = qwen3_moe.LAYOUTS["Qwen3MoeForCausalLM"]  # the same names


def layout(args: layers.ModelArgs) -> moe.Layout:
    return LAYOUT


def extra_shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """The shared expert's gate, the router and the experts (after the linears' weights)."""
    return {moe.SHARED_GATE: (1, args.hidden_size), **LAYOUT.shapes(args)}


def block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None,
    mask: torch.Tensor | None = None,
    router_logits: list | None = None,
) -> torch.Tensor:
    """(B·T, C) → (B·T, C); the router's logits (B·T, E) appended to `router_logits` if given."""
    eps = args.rms_norm_eps
    x = x + self_attention(layers.rms_norm(x, w["input_layernorm.weight"], eps), w, args, layer,
                           cos, sin, lora, mask=mask)  # fmt: skip
    h = layers.rms_norm(x, w["post_attention_layernorm.weight"], eps)
    routing = qwen3_moe.routing(args)
    routed = moe.split_moe_mlp(h, w, LAYOUT, args, routing, lora, router_logits)
    return x + (routed + moe.shared_expert(h, w, lora))
