"""Qwen3.5 / Qwen3.6 dense (text): hybrid blocks, Gated DeltaNet linear attention or gated full
attention, per `layer_types` (three linear layers to one full layer as released).

Every block: x + mixer(norm(x)), then x + MLP(norm(x)) (SwiGLU, Llama's). Every RMSNorm of the
block and the model scales by (1 + w) in fp32 (ModelArgs.norm_offset = 1), the q/k head norms
too; the linear layers' output norm is Llama's (models/gated_deltanet.py).

- `linear_attention` blocks: models/gated_deltanet.py (`linear_attn.*`);
- `full_attention` blocks: Qwen3's attention (q/k head norms, GQA) with RoPE on the first
  quarter of each head (partial_rotary_factor 0.25; the multimodal RoPE sections coincide for
  text, whose three position ids are equal), and an output gate: q_proj gives each head's query
  and a gate side by side (2·hs per head), and attention's output is multiplied by
  sigmoid(gate) before o_proj.

The blocks differ by kind, so this family gives its tensors and linear modules per block
(`block_shapes`, `linears`): models/__init__.py asks it for them.
"""

from __future__ import annotations

import torch

from appliance.models import gated_deltanet, layers
from appliance.models.attention import rotate

NORMS = ("input_layernorm", "post_attention_layernorm")
FULL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# every linear module some block has, in the order a block calls them
LINEARS = FULL + gated_deltanet.LINEARS + MLP
TARGETS = ("q", "k", "v", "o", *gated_deltanet.TARGET_MODULES, "gate", "up", "down")


def is_linear(args: layers.ModelArgs, layer: int) -> bool:
    return args.layer_types is not None and args.layer_types[layer] == "linear_attention"


def linears(args: layers.ModelArgs, layer: int) -> tuple[str, ...]:
    """Block `layer`'s linear modules, in the order it calls them."""
    return (gated_deltanet.LINEARS if is_linear(args, layer) else FULL) + MLP


def mixer_shapes(args: layers.ModelArgs, layer: int) -> dict[str, tuple[int, ...]]:
    """The norms and the mixer's tensors of block `layer` (Gated DeltaNet or full attention):
    what the dense and the MoE blocks share."""
    out: dict[str, tuple[int, ...]] = {f"{n}.weight": (args.hidden_size,) for n in NORMS}
    if is_linear(args, layer):
        out.update(gated_deltanet.shapes(args))
    else:
        out["self_attn.q_norm.weight"] = (args.head_dim,)
        out["self_attn.k_norm.weight"] = (args.head_dim,)
    mixer = gated_deltanet.LINEARS if is_linear(args, layer) else FULL
    out.update({f"{m}.weight": args.module_shape(m) for m in mixer})
    return out


def block_shapes(args: layers.ModelArgs, layer: int) -> dict[str, tuple[int, ...]]:
    """Block `layer`'s tensors (names under the block) with the shapes config.json implies."""
    return {**mixer_shapes(args, layer), **{f"{m}.weight": args.module_shape(m) for m in MLP}}


def norm(x: torch.Tensor, weight: torch.Tensor, args: layers.ModelArgs) -> torch.Tensor:
    return layers.rms_norm(x, weight, args.rms_norm_eps, args.norm_offset)


def gated_attention(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The full-attention mixer: (B·T, C) → (B·T, C); `mask`: see layers.attend."""
    T, nh, nkv, hs = cos.shape[-2], args.num_heads, args.num_kv_heads, args.head_dim
    q, gate = layers.linear(x, w, "self_attn.q_proj", lora).view(-1, T, nh, 2 * hs).chunk(2, -1)
    k = layers.linear(x, w, "self_attn.k_proj", lora).view(-1, T, nkv, hs)
    v = layers.linear(x, w, "self_attn.v_proj", lora).view(-1, T, nkv, hs)
    q = norm(q, w["self_attn.q_norm.weight"], args).transpose(1, 2)
    k = norm(k, w["self_attn.k_norm.weight"], args).transpose(1, 2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    y = layers.attend(q, k, v.transpose(1, 2), mask=mask)  # (B, nh, T, hs)
    y = layers.merge_heads(y, x) * torch.sigmoid(gate.reshape(x.shape[0], nh * hs))
    return layers.linear(y, w, "self_attn.o_proj", lora)


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
    x = x + mixer(x, w, args, layer, cos, sin, lora, mask)
    return x + layers.mlp(norm(x, w["post_attention_layernorm.weight"], args), w, lora)


def mixer(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The block's first half before the residual add: its mixer on the normed input."""
    h = norm(x, w["input_layernorm.weight"], args)
    if is_linear(args, layer):
        return gated_deltanet.linear_attention(h, w, args, lora, cos.shape[-2], mask)
    return gated_attention(h, w, args, cos, sin, lora, mask)
