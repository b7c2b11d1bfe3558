"""gpt-oss (GptOssForCausalLM): attention with a learned sink per head, sliding-window and full
layers alternating (`layer_types`), biases on every projection, YaRN RoPE; then a MoE MLP whose
router has a bias and picks the top k logits before a softmax over those k, and whose experts
have biases and a clamped SwiGLU.

Experts as the checkpoint stores them (and transformers holds them): fused and transposed,
`mlp.experts.gate_up_proj` (E, C, 2I) with gate and up columns interleaved (gate the even ones),
`gate_up_proj_bias` (E, 2I), `down_proj` (E, I, C), `down_proj_bias` (E, C). The released
checkpoints store the expert matrices in MXFP4 (`gate_up_proj_blocks` / `_scales`), which
are dequantized on load (models/mxfp4.py, hf_checkpoint).

Shapes: N rows, C hidden, E experts, I expert width, nh heads, hs head size, T sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.models import layers, moe
from appliance.models.attention import rotate

NORMS = ("input_layernorm", "post_attention_layernorm")
LINEARS = tuple(layers.TARGET_MODULES[t] for t in ("q", "k", "v", "o"))
TARGETS = ("q", "k", "v", "o", "experts")
DEFAULT_TARGETS = ("q", "k", "v", "o")
MOE = True
ROUTER, ROUTER_BIAS = "mlp.router.weight", "mlp.router.bias"
GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"
SINKS = "self_attn.sinks"
SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig defaults (hf_config refuses others)
SWIGLU_LIMIT = 7.0


def extra_shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """The sinks, the router and the experts' fused tensors."""
    E, C, width = args.num_experts, args.hidden_size, args.moe_intermediate_size
    return {
        SINKS: (args.num_heads,),
        ROUTER: (E, C),
        ROUTER_BIAS: (E,),
        GATE_UP: (E, C, 2 * width),
        GATE_UP_BIAS: (E, 2 * width),
        DOWN: (E, width, C),
        DOWN_BIAS: (E, C),
    }


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by w in fp32, then cast (GptOssRMSNorm; Llama's casts first)."""
    return F.rms_norm(x.float(), x.shape[-1:], w.float(), eps).to(x.dtype)


def sink_attention(q, k, v, sinks, window=None, mask=None) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs) whose softmax also counts
    one learned logit per head (`sinks` (nh,)) that attends to nothing: each query can give
    weight to no key. Scores written out (softmax with a sink is no SDPA kernel), as
    transformers' eager attention: max subtracted, softmax, the sink's column dropped."""
    T = q.shape[2]
    k, v = layers.repeat_kv(k, v, q.shape[1])
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, nh, T, T)
    i = torch.arange(T, device=q.device)
    keep = i[None, :] <= i[:, None]
    if window is not None and window < T:
        keep = keep & (i[:, None] - i[None, :] < window)
    if mask is not None:
        keep = keep & mask  # (B, 1, T, T): packed documents
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, T, 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return probs.to(v.dtype) @ v


def attention(x, w, args, layer, cos, sin, lora, mask=None) -> torch.Tensor:
    """(B·T, C) → (B·T, C)."""
    T, hs = cos.shape[-2], args.head_dim
    q = layers.heads(layers.linear(x, w, "self_attn.q_proj", lora), args.num_heads, hs, T)
    k = layers.heads(layers.linear(x, w, "self_attn.k_proj", lora), args.num_kv_heads, hs, T)
    v = layers.heads(layers.linear(x, w, "self_attn.v_proj", lora), args.num_kv_heads, hs, T)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    y = sink_attention(q, k, v, w[SINKS], args.window(layer), mask)
    return layers.linear(layers.merge_heads(y, x), w, "self_attn.o_proj", lora)


class GptOssExperts(moe.Experts):
    """The experts of one block (module docstring's layout), LoRA on them merged per expert
    as PEFT does for a transposed 3-D parameter: W_j + scale · (B_j A_j)ᵀ."""

    def __init__(self, w: dict, lora=None):
        self.w, self.num = w, w[GATE_UP].shape[0]
        weights = lora.weights if lora is not None else {}
        self.lora = {m: weights.get(m) for m in (moe.GATE_UP, moe.DOWN)}
        self.scale = lora.scale if lora is not None else 1.0

    def _weight(self, name: str, module: str, j: int) -> torch.Tensor:
        W = self.w[name][j]  # (in, out)
        if self.lora[module] is None:
            return W
        B, A = moe.expert_lora(self.lora[module], j, self.num)
        return torch.addmm(W, A.T, B.T, alpha=self.scale)

    def forward(self, j: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self._weight(GATE_UP, moe.GATE_UP, j) + self.w[GATE_UP_BIAS][j]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=SWIGLU_LIMIT)
        up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        h = (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))
        return h @ self._weight(DOWN, moe.DOWN, j) + self.w[DOWN_BIAS][j]


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
    x = x + attention(rms_norm(x, w["input_layernorm.weight"], eps), w, args, layer, cos, sin,
                      lora, mask)  # fmt: skip
    h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
    routing = moe.Routing(args.experts_per_token, softmax_first=False)
    y, logits = moe.sparse_moe(h, w[ROUTER], GptOssExperts(w, lora), routing, w[ROUTER_BIAS])
    if router_logits is not None:
        router_logits.append(logits)
    return x + y
