"""Gemma 4 dense (text): Gemma's sandwich-normed blocks, with what Gemma 4 adds.

- Norms scale by w in fp32 (no 1 + w); values get an RMSNorm without scale (`v_norm`); scores
  are not scaled (softmax scale 1: ModelArgs.attn_scale), the q/k head norms carry the scale.
- Sliding layers (head_dim, num_kv_heads, RoPE base rope_local_theta) beside full layers with a
  head of their own (global_head_dim: 512 as released, num_global_kv_heads) and "proportional"
  RoPE (rope.proportional_inv_freq); with attention_k_eq_v a full layer has no v_proj: its
  values are its key projection (before the key norm and RoPE).
- KV sharing: the last num_kv_shared_layers blocks have no k/v projections; they attend over the
  keys and values of the last earlier block of their layer type (the "store" block). Across the
  streamed step those K/V are state between blocks, kept per micro-batch in a `BlockState` (see
  it for the backward); their K/V gradients flow back into the store block.
- Per-layer embeddings (PLE): a table of per_layer_dim values per block and token (262144 rows
  × L·256 as released: gigabytes), kept in host memory (models.HOST_GLOBALS: the engine never
  moves it to the device) and gathered for each micro-batch's tokens; mixed with a projection
  of the token embeddings into one (tokens, L, per_layer_dim) input, block i reading its slice,
  gated into the residual after the MLP (`per_layer_input_gate`, `per_layer_projection`).
- Each block's output is scaled by its `layer_scalar`; KV-shared blocks may have a double-wide
  MLP (use_double_wide_mlp).

- The MoE block (26B-A4B: enable_moe_block): every block keeps its dense MLP and adds routed
  experts beside it, on the same input x (the residual stream after attention):

      mlp = post_ff_1(MLP(pre_ff(x))) + post_ff_2(experts(pre_ff_2(x)))

  then post_feedforward_layernorm and the residual add as in the dense block. The router
  (`router.*`) reads x through an RMSNorm without weight, times `router.scale` and C^-1/2;
  softmax over the experts (fp32), top k, renormalised, each weight times its expert's
  `router.per_expert_scale`. The experts are fused as the files store them and transformers
  holds them (`experts.gate_up_proj` (E, 2I, C), `experts.down_proj` (E, C, I)), with GELU
  (tanh) gating; LoRA on them is PEFT's target_parameters (`experts.gate_up_proj`,
  `experts.down_proj`). No load-balancing loss (transformers' Gemma 4 adds none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.models import gemma, layers, moe
from appliance.models.attention import rotate

NORMS = gemma.NORMS
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PER_LAYER = ("per_layer_input_gate", "per_layer_projection")
LINEARS = ATTENTION + MLP + PER_LAYER  # in the order a block calls them
TARGETS = (*layers.TARGET_MODULES, "experts")  # experts: the MoE block's
# the model's tensors outside the blocks that PLE adds
PER_LAYER_TABLE = "model.embed_tokens_per_layer.weight"
PER_LAYER_GLOBALS = (
    PER_LAYER_TABLE,
    "model.per_layer_model_projection.weight",
    "model.per_layer_projection_norm.weight",
)


# the MoE block (enable_moe_block)
ROUTER, ROUTER_SCALE, EXPERT_SCALE = "router.proj.weight", "router.scale", "router.per_expert_scale"
GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"  # also their LoRA modules' names
EXPERT_MODULES = (GATE_UP, DOWN)
MOE_NORMS = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
             "post_feedforward_layernorm_2")  # fmt: skip


def linears(args: layers.ModelArgs, layer: int) -> tuple[str, ...]:
    """Block `layer`'s linear modules: no k/v projection in a KV-shared block, no v_proj in a
    full block with attention_k_eq_v, the PLE gate and projection where the model has PLE."""
    shared = args.kv_shared(layer)
    out = ["self_attn.q_proj"]
    if not shared:
        out.append("self_attn.k_proj")
        if not (args.attention_k_eq_v and args.is_global(layer)):
            out.append("self_attn.v_proj")
    out += ["self_attn.o_proj", *MLP]
    if args.per_layer_dim:
        out += PER_LAYER
    return tuple(out)


def block_shapes(args: layers.ModelArgs, layer: int) -> dict[str, tuple[int, ...]]:
    C = args.hidden_size
    _, hs = args.attention_heads(layer)
    out: dict[str, tuple[int, ...]] = {f"{n}.weight": (C,) for n in NORMS}
    out["self_attn.q_norm.weight"] = (hs,)
    if not args.kv_shared(layer):
        out["self_attn.k_norm.weight"] = (hs,)
    if args.per_layer_dim:
        out["post_per_layer_input_norm.weight"] = (C,)
    out["layer_scalar"] = (1,)
    for module in linears(args, layer):
        out[f"{module}.weight"] = args.module_shape(module, layer)
    if args.num_experts:
        E, width = args.num_experts, args.moe_intermediate_size
        out.update({f"{n}.weight": (C,) for n in MOE_NORMS})
        out.update({ROUTER: (E, C), ROUTER_SCALE: (C,), EXPERT_SCALE: (E,)})
        out.update({GATE_UP: (E, 2 * width, C), DOWN: (E, C, width)})
    return out


def global_shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """The PLE tensors outside the blocks (none without PLE)."""
    if not args.per_layer_dim:
        return {}
    width = args.num_layers * args.per_layer_dim
    return {
        PER_LAYER_TABLE: (args.per_layer_vocab, width),
        "model.per_layer_model_projection.weight": (width, args.hidden_size),
        "model.per_layer_projection_norm.weight": (args.per_layer_dim,),
    }


def norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: normalized and scaled by w in fp32, then cast; no scale for None."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (h if weight is None else h * weight.float()).to(x.dtype)


def store_block(args: layers.ModelArgs, kind: str) -> int:
    """The block whose keys and values the KV-shared blocks of layer type `kind` reuse: the last
    block of that type before them."""
    first_shared = args.num_layers - args.num_kv_shared_layers
    return max(i for i in range(first_shared) if args.layer_types[i] == kind)


class BlockState:
    """What Gemma 4's blocks share across one micro-batch's pass through the streamed step: its
    per-layer inputs (tokens, L, per_layer_dim), and the store blocks' keys and values.

    Forward (no grad): a store block keeps its K/V here (`keep`); the KV-shared blocks after it
    read them (`shared`). Backward (reverse layer order, each block recomputed with grad): the
    KV-shared blocks come first; `shared` turns the kept K/V into leaves, so every reusing
    block's backward adds its gradient to them. When the store block is recomputed, `keep` pairs
    its fresh K/V with those gradients, and the engine backpropagates them together with the
    block's output (`roots`): the store block's k_proj/v_proj adapters and its input get the
    reusers' share of the gradient. Only what the model shares is kept: two (B, nkv, T, hs) pairs
    per micro-batch (one per layer type), for the whole step."""

    def __init__(self, per_layer: torch.Tensor | None = None):
        self.per_layer = per_layer
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def shared(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv[kind]
        if torch.is_grad_enabled() and not k.requires_grad:
            k, v = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
            self.kv[kind] = (k, v)
        return k, v

    def keep(self, kind: str, k: torch.Tensor, v: torch.Tensor) -> None:
        kept = self.kv.get(kind)
        if torch.is_grad_enabled() and kept is not None and kept[0].requires_grad:
            for fresh, leaf in zip((k, v), kept, strict=True):
                if leaf.grad is not None:
                    self._pending.append((fresh, leaf.grad))
            del self.kv[kind]  # the reusers are done with it
            return
        self.kv[kind] = (k, v)

    def roots(
        self, y: torch.Tensor, grad: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outputs, their gradients) to backpropagate from for the block just recomputed."""
        pending, self._pending = self._pending, []
        return [y, *(t for t, _ in pending)], [grad, *(g for _, g in pending)]


def per_layer_inputs(
    ids: torch.Tensor,
    g: dict[str, torch.Tensor],
    table: torch.Tensor,
    args: layers.ModelArgs,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """PLE's per-layer inputs (B·T, L, per_layer_dim) for `ids` (B, T): the host `table`'s rows
    for these tokens (gathered on the host, then copied), times sqrt(per_layer_dim), plus the
    normed projection of the token embeddings, the sum times 2^-1/2 (transformers' order)."""
    L, P = args.num_layers, args.per_layer_dim
    rows = F.embedding(ids.to(table.device), table).to(device=device, dtype=dtype)
    tok = rows * torch.tensor(P**0.5, dtype=dtype)
    h = layers.embed(ids.to(device), g, args.embed_scale)
    proj = F.linear(h, g["model.per_layer_model_projection.weight"]) * args.hidden_size**-0.5
    proj = norm(
        proj.view(*ids.shape, L, P), g["model.per_layer_projection_norm.weight"], args.rms_norm_eps
    )
    out = (proj + tok.view(*ids.shape, L, P)) * 2.0**-0.5
    return out.view(-1, L, P)


def attention(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None,
    mask: torch.Tensor | None,
    state: BlockState | None,
) -> torch.Tensor:
    T, nh, eps = cos.shape[-2], args.num_heads, args.rms_norm_eps
    nkv, hs = args.attention_heads(layer)
    kind = args.layer_types[layer]
    q = layers.linear(x, w, "self_attn.q_proj", lora).view(-1, T, nh, hs)
    q = rotate(norm(q, w["self_attn.q_norm.weight"], eps).transpose(1, 2), cos, sin)
    if args.kv_shared(layer):
        k, v = state.shared(kind)
    else:
        k = layers.linear(x, w, "self_attn.k_proj", lora).view(-1, T, nkv, hs)
        v = k
        if "self_attn.v_proj.weight" in w:
            v = layers.linear(x, w, "self_attn.v_proj", lora).view(-1, T, nkv, hs)
        k = rotate(norm(k, w["self_attn.k_norm.weight"], eps).transpose(1, 2), cos, sin)
        v = norm(v, None, eps).transpose(1, 2)
        if args.num_kv_shared_layers and layer == store_block(args, kind):
            state.keep(kind, k, v)
    y = layers.attend(q, k, v, args.attn_scale, args.window(layer), None, mask)
    return layers.linear(layers.merge_heads(y, x), w, "self_attn.o_proj", lora)


class Experts(moe.Experts):
    """A MoE block's experts as stored (E, 2I, C) and (E, C, I), GELU (tanh) gated; LoRA on
    them (PEFT's layout for a 3-D parameter) merged into each expert's weight before its
    matmul, as PEFT does."""

    def __init__(self, w: dict[str, torch.Tensor], lora: layers.LoraContext | None):
        self.gate_up_w, self.down_w, self.num = w[GATE_UP], w[DOWN], w[GATE_UP].shape[0]
        weights = lora.weights if lora is not None else {}
        self.lora = {m: weights.get(m) for m in EXPERT_MODULES}
        self.scale = lora.scale if lora is not None else 1.0

    def _weight(self, W: torch.Tensor, module: str, j: int) -> torch.Tensor:
        if self.lora[module] is None:
            return W[j]
        B, A = moe.expert_lora(self.lora[module], j, self.num)
        return torch.addmm(W[j], B, A, alpha=self.scale)

    def forward(self, j: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self._weight(self.gate_up_w, GATE_UP, j)).chunk(2, dim=-1)
        h = F.gelu(gate, approximate="tanh") * up
        return F.linear(h, self._weight(self.down_w, DOWN, j))


def experts_mlp(
    x: torch.Tensor, w: dict[str, torch.Tensor], args: layers.ModelArgs, lora
) -> torch.Tensor:
    """The MoE block's routed half on the residual rows x (N, C), normed after the experts
    (post_feedforward_layernorm_2): see the module docstring."""
    eps, C = args.rms_norm_eps, args.hidden_size
    h = norm(x, None, eps) * w[ROUTER_SCALE] * C**-0.5
    logits = F.linear(h, w[ROUTER])
    routing = moe.Routing(args.experts_per_token, renormalize=True, cast=False)
    weights, index = moe.route(logits, routing)
    weights = weights * w[EXPERT_SCALE][index]
    h = norm(x, w["pre_feedforward_layernorm_2.weight"], eps)
    y = moe.experts_forward(h, weights, index, Experts(w, lora))
    return norm(y, w["post_feedforward_layernorm_2.weight"], eps)


def block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None,
    mask: torch.Tensor | None = None,
    state: BlockState | None = None,
    router_logits: list | None = None,
) -> torch.Tensor:
    """(B·T, C) → (B·T, C). `state`: the micro-batch's BlockState (per-layer inputs, shared
    K/V); needed where the model has either. (`router_logits`: unused, Gemma 4 has no
    load-balancing loss.)"""
    eps = args.rms_norm_eps
    h = attention(
        norm(x, w["input_layernorm.weight"], eps), w, args, layer, cos, sin, lora, mask, state
    )
    x = x + norm(h, w["post_attention_layernorm.weight"], eps)
    h = gemma.mlp(norm(x, w["pre_feedforward_layernorm.weight"], eps), w, lora)
    if args.num_experts:
        h = norm(h, w["post_feedforward_layernorm_1.weight"], eps) + experts_mlp(x, w, args, lora)
    x = x + norm(h, w["post_feedforward_layernorm.weight"], eps)
    if args.per_layer_dim:
        gate = F.gelu(layers.linear(x, w, "per_layer_input_gate", lora), approximate="tanh")
        h = layers.linear(gate * state.per_layer[:, layer], w, "per_layer_projection", lora)
        x = x + norm(h, w["post_per_layer_input_norm.weight"], eps)
    return x * w["layer_scalar"]
