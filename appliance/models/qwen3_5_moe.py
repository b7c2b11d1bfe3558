"""Qwen3.5 / Qwen3.6 MoE (Qwen3_5MoeForCausalLM, and the language model of
Qwen3_5MoeForConditionalGeneration): the hybrid blocks of Qwen3.5 dense (models/qwen3_5.py:
Gated DeltaNet or gated full attention, per `layer_types`), each followed by a sparse MoE MLP
with a shared expert instead of the dense MLP (transformers' Qwen3_5MoeSparseMoeBlock):

    y = routed experts(h) + sigmoid(h · shared_expert_gateᵀ) · shared_expert(h)

Routing: softmax over the experts (fp32), top k, always renormalised, cast back (moe.Routing).
Every block is sparse. The released checkpoints store the experts fused, as transformers v5
holds them (`mlp.experts.gate_up_proj` (E, 2I, C), `mlp.experts.down_proj` (E, C, I):
ModelArgs.fused_experts, read from the files' names); transformers' save_pretrained writes
them apart, as Qwen3-MoE's (`mlp.experts.{j}.gate_proj.weight`): both are read. The router is
`mlp.gate.weight`, the shared expert a plain MLP (`mlp.shared_expert.{gate,up,down}_proj.weight`)
with its gate `mlp.shared_expert_gate.weight` (1, C).

LoRA: both mixers' projections by default (what the Llama default targets mean here), the
shared expert's linears as ordinary targets (shared_gate, shared_up, shared_down; written
`shared_expert.gate_proj` … in target_modules), the routed experts with `experts` (PEFT's
target_parameters); the router and the shared expert's gate never.
"""

from __future__ import annotations

import torch

from appliance.models import gated_deltanet, layers, moe, qwen3_5

MOE = True
NORMS = qwen3_5.NORMS
LINEARS = qwen3_5.FULL + gated_deltanet.LINEARS + moe.SHARED  # every linear some block has
_MIXER = ("q", "k", "v", "o", *gated_deltanet.TARGET_MODULES)
TARGETS = (*_MIXER, "shared_gate", "shared_up", "shared_down", "experts")
DEFAULT_TARGETS = _MIXER  # what --lora-targets' Llama defaults mean here: both mixers

LAYOUT = moe.Layout(
    "mlp.gate.weight",
    "mlp.experts.{}.gate_proj.weight",
    "mlp.experts.{}.up_proj.weight",
    "mlp.experts.{}.down_proj.weight",
)


def layout(args: layers.ModelArgs) -> moe.Layout | None:
    """The experts' names when stored apart (None: fused)."""
    return None if args.fused_experts else LAYOUT


def expert_shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """The router and the experts, stored apart or fused."""
    if not args.fused_experts:
        return LAYOUT.shapes(args)
    E, C, width = args.num_experts, args.hidden_size, args.moe_intermediate_size
    return {LAYOUT.router: (E, C), moe.GATE_UP: (E, 2 * width, C), moe.DOWN: (E, C, width)}


def routing(args: layers.ModelArgs) -> moe.Routing:
    return moe.Routing(args.experts_per_token, renormalize=True)


def linears(args: layers.ModelArgs, layer: int) -> tuple[str, ...]:
    """Block `layer`'s linear modules, in the order it calls them."""
    mixer = gated_deltanet.LINEARS if qwen3_5.is_linear(args, layer) else qwen3_5.FULL
    return mixer + moe.SHARED


def block_shapes(args: layers.ModelArgs, layer: int) -> dict[str, tuple[int, ...]]:
    """Block `layer`'s tensors: norms and mixer (as Qwen3.5 dense), the shared expert and its
    gate, then the router and the experts."""
    return {**qwen3_5.mixer_shapes(args, layer), **moe.shared_shapes(args),
            **expert_shapes(args)}  # fmt: skip


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
    x = x + qwen3_5.mixer(x, w, args, layer, cos, sin, lora, mask)
    h = qwen3_5.norm(x, w["post_attention_layernorm.weight"], args)
    if args.fused_experts:
        experts = moe.FusedExperts(w[moe.GATE_UP], w[moe.DOWN], lora)
        routed, logits = moe.sparse_moe(h, w[LAYOUT.router], experts, routing(args))
        if router_logits is not None:
            router_logits.append(logits)
    else:
        routed = moe.split_moe_mlp(h, w, LAYOUT, args, routing(args), lora, router_logits)
    return x + (routed + moe.shared_expert(h, w, lora))
