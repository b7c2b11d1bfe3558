"""OLMoE (OlmoeForCausalLM): Llama attention with RMSNorm over the whole q and k projections
(not per head: `q_norm` is hidden-sized, `k_norm` key/value-sized) before RoPE, q, k and v
optionally clamped to ±clip_qkv, then a sparse MoE MLP routed as Qwen3-MoE's (models/moe.py;
checkpoint names as Qwen3-MoE's: `mlp.gate.weight`, `mlp.experts.{j}.gate_proj.weight`, ...).
"""

from __future__ import annotations

import torch

from appliance.models import layers, moe, qwen3_moe

NORMS = ("input_layernorm", "post_attention_layernorm")
LINEARS = qwen3_moe.LINEARS
TARGETS = qwen3_moe.TARGETS
MOE = True  # a mixture of experts (hf_checkpoint.MOE_ARCHITECTURES)
DEFAULT_TARGETS = qwen3_moe.DEFAULT_TARGETS
LAYOUT = qwen3_moe.LAYOUTS["Qwen3MoeForCausalLM"]


def layout(args: layers.ModelArgs) -> moe.Layout:
    return LAYOUT


def extra_shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """The q and k norms, the router and the experts."""
    return {
        "self_attn.q_norm.weight": (args.num_heads * args.head_dim,),
        "self_attn.k_norm.weight": (args.num_kv_heads * args.head_dim,),
        **LAYOUT.shapes(args),
    }


def attention(x, w, args, cos, sin, lora, mask=None) -> torch.Tensor:
    """(B·T, C) → (B·T, C)."""
    T, hs, eps = cos.shape[-2], args.head_dim, args.rms_norm_eps
    q = layers.rms_norm(
        layers.linear(x, w, "self_attn.q_proj", lora), w["self_attn.q_norm.weight"], eps
    )
    k = layers.rms_norm(
        layers.linear(x, w, "self_attn.k_proj", lora), w["self_attn.k_norm.weight"], eps
    )
    v = layers.linear(x, w, "self_attn.v_proj", lora)
    if args.clip_qkv is not None:
        q, k, v = (t.clamp(-args.clip_qkv, args.clip_qkv) for t in (q, k, v))
    q = layers.apply_rope(layers.heads(q, args.num_heads, hs, T), cos, sin)
    k = layers.apply_rope(layers.heads(k, args.num_kv_heads, hs, T), cos, sin)
    v = layers.heads(v, args.num_kv_heads, hs, T)
    y = layers.attend(q, k, v, mask=mask)  # (B, nh, T, hs)
    return layers.linear(layers.merge_heads(y, x), w, "self_attn.o_proj", lora)


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
    """(B·T, C) → (B·T, C); the router's logits appended to `router_logits` if given."""
    eps = args.rms_norm_eps
    x = x + attention(layers.rms_norm(x, w["input_layernorm.weight"], eps), w, args, cos, sin,
                      lora, mask)  # fmt: skip
    h = layers.rms_norm(x, w["post_attention_layernorm.weight"], eps)
    routing = moe.Routing(args.experts_per_token, renormalize=args.norm_topk_prob)
    return x + moe.split_moe_mlp(h, w, LAYOUT, args, routing, lora, router_logits)
