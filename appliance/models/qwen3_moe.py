"""Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM): the attention of Qwen3
(q/k head norms) and of Mistral (plain, an optional sliding window), each followed by a sparse
MoE MLP (models/moe.py) instead of the dense one.

Routing: softmax over the experts, top k; Qwen3-MoE renormalises the k weights when
norm_topk_prob, Mixtral always (and weights the experts' outputs in fp32). Released checkpoints
store each expert's matrices apart: Qwen3-MoE `mlp.experts.{j}.gate_proj.weight` (up, down),
router `mlp.gate.weight`; Mixtral `block_sparse_moe.experts.{j}.w1.weight` (gate; w3 up, w2
down), router `block_sparse_moe.gate.weight`. transformers v5 fuses them in memory
(`mlp.experts.gate_up_proj` (E, 2I, C), `mlp.experts.down_proj` (E, C, I)) and writes them
back apart; PEFT's LoRA on the experts (`target_parameters`) adapts the fused tensors, and the
blocks here apply it expert by expert (moe.SplitExperts).
"""

from __future__ import annotations

import torch

from appliance.models import layers, moe
from appliance.models.attention import self_attention

NORMS = ("input_layernorm", "post_attention_layernorm")
LINEARS = tuple(layers.TARGET_MODULES[t] for t in ("q", "k", "v", "o"))
TARGETS = ("q", "k", "v", "o", "experts")
# the attention targets by default: --lora-targets' Llama defaults name gate/up/down, which a
# MoE block has only inside its experts
MOE = True  # a mixture of experts (hf_checkpoint.MOE_ARCHITECTURES)
DEFAULT_TARGETS = ("q", "k", "v", "o")

LAYOUTS = {
    "Qwen3MoeForCausalLM": moe.Layout(
        "mlp.gate.weight",
        "mlp.experts.{}.gate_proj.weight",
        "mlp.experts.{}.up_proj.weight",
        "mlp.experts.{}.down_proj.weight",
    ),
    "MixtralForCausalLM": moe.Layout(
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{}.w1.weight",
        "block_sparse_moe.experts.{}.w3.weight",
        "block_sparse_moe.experts.{}.w2.weight",
    ),
}


def layout(args: layers.ModelArgs) -> moe.Layout:
    return LAYOUTS[args.architecture]


def routing(args: layers.ModelArgs) -> moe.Routing:
    if args.architecture == "MixtralForCausalLM":
        return moe.Routing(args.experts_per_token, renormalize=True, cast=False)
    return moe.Routing(args.experts_per_token, renormalize=args.norm_topk_prob)


def extra_shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """The router and the experts (models.block_shapes adds them after the attention)."""
    return layout(args).shapes(args)


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
    return x + moe.split_moe_mlp(h, w, layout(args), args, routing(args), lora, router_logits)
