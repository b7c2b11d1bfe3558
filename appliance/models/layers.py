"""The Llama-family model math: shapes, RoPE (applied; its tables: rope.py), attention, MLP,
LoRA, loss.

Everything here is a pure function of (activations, weights). Weights arrive as a dict of tensors
per transformer block, keyed by the Hugging Face names with the `model.layers.{i}.` prefix removed
(`self_attn.q_proj.weight`, `mlp.down_proj.weight`, `input_layernorm.weight`, ...), so the same
code runs on weights that stay resident and on weights streamed in from host memory.

Shapes: B batch, T sequence, C hidden size, nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from appliance.models.kv_cache import KVCache

# LoRA target short names → the HF module they adapt inside a block.
TARGET_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


@dataclass(frozen=True)
class ModelArgs:
    """The shape and numerics of a Llama-family model (read from HF `config.json`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # sorted (key, value) items of the scaling; "rope_type" is llama3 when absent, else linear,
    # longrope (whose short_factor / long_factor values are tuples) or yarn
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    attention_bias: bool = False  # bias on q, k, v (Qwen2, some Llamas)
    o_bias: bool = False  # bias on o_proj (Llama with attention_bias)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # ---- what the newer families add (defaults: Llama); see appliance/models/
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w) in fp32: 1.0 for Gemma
    embed_scale: float | None = None  # embeddings × this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # scores → cap·tanh(scores/cap) (Gemma 2)
    final_softcap: float | None = None  # logits → cap·tanh(logits/cap) (Gemma 2)
    # per block "sliding_attention" | "full_attention"; None: `sliding_window` (if set) everywhere
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers (unscaled)
    partial_rotary_factor: float = 1.0  # RoPE on the first hs·factor dimensions (Phi-4-mini)
    # the multimodal architecture whose language model this is (Gemma3ForConditionalGeneration):
    # its tensors and adapter keys are named under it (models/multimodal.py); None: a text model
    language_model_of: str | None = None
    # ---- mixture of experts (models/moe.py); num_experts 0: a dense model
    num_experts: int = 0
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's MLP width
    shared_expert_intermediate_size: int = 0  # the shared expert's width (0: none; moe.py)
    # the experts stored as 3-D tensors (mlp.experts.gate_up_proj, as the released Qwen3.5-MoE
    # files hold them), not one matrix per expert (as transformers' save_pretrained writes them)
    fused_experts: bool = False
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    router_aux_coef: float = 0.0  # the load-balancing loss's weight (0: not added)
    clip_qkv: float | None = None  # q, k, v clamped to ±clip_qkv (OLMoE)
    # ---- hybrid linear attention (Qwen3.5: layer_types "linear_attention"; models/qwen3_5.py)
    attn_output_gate: bool = False  # q_proj also gives a sigmoid gate on attention's output
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0  # the causal depthwise convolution's width
    # ---- Gemma 4 (models/gemma4.py)
    global_head_dim: int = 0  # the full-attention layers' head size (0: head_dim)
    num_global_kv_heads: int = 0  # their key/value heads (0: num_kv_heads)
    attention_k_eq_v: bool = False  # full layers: values are the key projection (no v_proj)
    num_kv_shared_layers: int = 0  # the last blocks reuse an earlier block's keys and values
    double_wide_mlp: bool = False  # those blocks' MLP is twice as wide
    per_layer_dim: int = 0  # per-layer embeddings' width per block (0: none)
    per_layer_vocab: int = 0  # their table's rows

    def window(self, layer: int) -> int | None:
        """The sliding window of block `layer` (keys within `window` positions), None: causal."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Block `layer` takes the local RoPE table (base rope_local_theta): Gemma 3's sliding
        layers."""
        return self.rope_local_theta is not None and self.window(layer) is not None

    def is_global(self, layer: int) -> bool:
        """Block `layer` is a Gemma 4 full-attention block with its own head size and heads."""
        return bool(self.global_head_dim) and self.window(layer) is None

    def attention_heads(self, layer: int) -> tuple[int, int]:
        """(key/value heads, head size) of block `layer`."""
        if self.is_global(layer):
            return self.num_global_kv_heads or self.num_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim

    def kv_shared(self, layer: int) -> bool:
        """Block `layer` reuses an earlier block's keys and values (Gemma 4's last blocks)."""
        return layer >= self.num_layers - self.num_kv_shared_layers

    def module_shape(self, module: str, layer: int = 0) -> tuple[int, int]:
        """(out_features, in_features) of block `layer`'s linear module, e.g. `self_attn.q_proj`
        (the same in every block but Gemma 4's, whose full-attention blocks have their own head
        size and whose KV-shared blocks may have a double-wide MLP)."""
        C, inter = self.hidden_size, self.intermediate_size
        nkv, hs = self.attention_heads(layer)
        if self.double_wide_mlp and self.kv_shared(layer):
            inter *= 2
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = self.linear_num_value_heads * self.linear_value_head_dim
        return {
            "self_attn.q_proj": (self.num_heads * hs * (2 if self.attn_output_gate else 1), C),
            "self_attn.k_proj": (nkv * hs, C),
            "self_attn.v_proj": (nkv * hs, C),
            "self_attn.o_proj": (C, self.num_heads * hs),
            "mlp.gate_proj": (inter, C),
            "mlp.up_proj": (inter, C),
            "mlp.down_proj": (C, inter),
            # Phi-3's fused modules: rows are q, k, v (resp. gate, up) one after the other
            "self_attn.qkv_proj": ((self.num_heads + 2 * self.num_kv_heads) * hs, C),
            "mlp.gate_up_proj": (2 * inter, C),
            # one expert's share of a MoE block's fused expert tensors (models/moe.py)
            "mlp.experts.gate_up_proj": (2 * self.moe_intermediate_size, C),
            "mlp.experts.down_proj": (C, self.moe_intermediate_size),
            "experts.gate_up_proj": (2 * self.moe_intermediate_size, C),  # Gemma 4's
            "experts.down_proj": (C, self.moe_intermediate_size),
            # the shared expert beside the routed ones (Qwen3.5-MoE, Qwen2-MoE: moe.py)
            "mlp.shared_expert.gate_proj": (self.shared_expert_intermediate_size, C),
            "mlp.shared_expert.up_proj": (self.shared_expert_intermediate_size, C),
            "mlp.shared_expert.down_proj": (C, self.shared_expert_intermediate_size),
            # Gemma 4's per-layer embeddings
            "per_layer_input_gate": (self.per_layer_dim, C),
            "per_layer_projection": (C, self.per_layer_dim),
            # Gated DeltaNet (models/gated_deltanet.py)
            "linear_attn.in_proj_qkv": (2 * kd + vd, C),
            "linear_attn.in_proj_z": (vd, C),
            "linear_attn.in_proj_b": (self.linear_num_value_heads, C),
            "linear_attn.in_proj_a": (self.linear_num_value_heads, C),
            "linear_attn.out_proj": (C, vd),
        }[module]


# ---------------------------------------------------------------- RoPE


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, with rotate_half(x) = (-x2, x1) for the halves x1, x2 of a head
    (transformers' convention). x (B, n, T, hs), cos/sin (T, hs) or (B, 1, T, hs) from
    `rope.rope_cos_sin`, whose sin has its first half negated.

    Written without the negated half and the cat: (-x2, x1)·(s1, s2) = (x2, x1)·(-s1, s2), so the
    halves are swapped by one roll and the sign lives in the sin table. Bitwise equal to
    transformers (a negation does not round); addcmul would save one more pass but rounds its
    multiply-add differently (1 ulp), which doubled the worst parity error against transformers.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


# ---------------------------------------------------------------- packed documents


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, 1, T, T) for packed rows: query t sees key s iff s ≤ t and both
    belong to the same document (`segments` (B, T) numbers the documents of each row)."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]


def document_block_mask(segments: torch.Tensor):
    """The same mask as `document_mask`, as a flex_attention BlockMask (CUDA): blocks of the
    (T, T) score matrix that no query may see are skipped, not computed and then masked."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = segments.shape

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (segments[b, q] == segments[b, kv])

    return create_block_mask(same_document_causal, B, None, T, T, device=segments.device)


_FLEX = None


def _flex_attention(q, k, v, block_mask, enable_gqa: bool) -> torch.Tensor:
    """flex_attention, compiled once per process (uncompiled it materializes the scores)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


# ---------------------------------------------------------------- layers


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm over the last dimension as transformers computes it: normalized in fp32, then
    scaled by w in the compute dtype (LlamaRMSNorm), or by (offset + w) in fp32 before the cast
    (Gemma, offset 1). F.rms_norm is one fused kernel on CUDA; on CPU it computes the same
    x·rsqrt(mean(x²) + eps) (bitwise equal to writing it out)."""
    if offset:
        return F.rms_norm(x.float(), x.shape[-1:], offset + weight.float(), eps).to(x.dtype)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


@dataclass
class LoraContext:
    """What a block needs to apply LoRA: per-module (A, B) and how to drop out.

    `weights[module] = (A (r, in), B (out, r))` in the compute dtype, B times `scale` where
    LoraWeights.context folded the scale in (then `scale` is 1). Dropout masks come from
    `generator`, seeded per (step, block, micro-batch) by the engine, so recomputing a block in
    backward draws exactly the masks its forward drew.
    """

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    dropout: float = 0.0
    generator: torch.Generator | None = None
    # module → its dropout mask, drawn before the block runs (models.compiled_block_forward);
    # None: each projection draws its own from `generator`
    masks: dict[str, torch.Tensor] | None = None
    # the fast kernels (LoraWeights.context(kernels="fast")): module → (the stacked A of the
    # projections that read its input, its index there); None: each projection its own A
    stacked: dict[str, tuple[torch.Tensor, int]] | None = None
    # the last stacked product per stack: (its input, its per-projection parts)
    products: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = field(default_factory=dict)

    def low_rank_input(self, x: torch.Tensor, module: str) -> torch.Tensor:
        """dropout(x) Aᵀ for `module`'s A: with a stack (no dropout), x times every A of the
        stack in one matmul, made for the stack's first projection and split for each."""
        A, _ = self.weights[module]
        if self.stacked is not None and module in self.stacked:
            stack, j = self.stacked[module]
            made = self.products.get(id(stack))
            if made is None or made[0] is not x:  # a new input (the next micro-batch's)
                made = (x, F.linear(x, stack).split(A.shape[0], dim=-1))
                self.products[id(stack)] = made
            return made[1][j]
        h = x
        if self.dropout > 0:
            keep = 1.0 - self.dropout
            if self.masks is not None:
                mask = self.masks[module]
            else:
                mask = torch.empty_like(x).bernoulli_(keep, generator=self.generator)
            h = x * mask / keep
        return F.linear(h, A)


def linear(
    x: torch.Tensor, w: dict[str, torch.Tensor], module: str, lora: LoraContext | None
) -> torch.Tensor:
    """x Wᵀ + b, plus LoRA's scale · dropout(x) Aᵀ Bᵀ when `lora` adapts `module` (PEFT's order
    of operations: the product, then the scale, then the add; see docs/benchmarks.md 2026-11-23
    for why not one addmm_)."""
    y = F.linear(x, w[f"{module}.weight"], w.get(f"{module}.bias"))
    if lora is not None and module in lora.weights:
        lo = F.linear(lora.low_rank_input(x, module), lora.weights[module][1])
        y = y + (lo if lora.scale == 1.0 else lo * lora.scale)
    return y


def attention(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: ModelArgs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: LoraContext | None,
    mask=None,
) -> torch.Tensor:
    """Self-attention of x (B·T, C) or (B, T, C), T the RoPE table's length (see `heads`).
    `mask`: None (causal), a bool tensor (B, 1, T, T) from `document_mask` (packed documents,
    plain SDPA), a flex_attention BlockMask (packed documents on CUDA), or the block's KVCache
    (generating: the keys so far, models/kv_cache.py)."""
    T, hs = cos.shape[-2], args.head_dim
    q = heads(linear(x, w, "self_attn.q_proj", lora), args.num_heads, hs, T)
    k = heads(linear(x, w, "self_attn.k_proj", lora), args.num_kv_heads, hs, T)
    v = heads(linear(x, w, "self_attn.v_proj", lora), args.num_kv_heads, hs, T)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, nh|nkv, T, hs)
    gqa = args.num_kv_heads != args.num_heads
    if isinstance(mask, KVCache):
        k, v = mask.append(k, v)
        y = masked_sdpa(q, k, v, mask.visible(None))
    elif mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif isinstance(mask, torch.Tensor):
        y = masked_sdpa(q, k, v, mask)
    else:
        y = _flex_attention(q, k, v, mask, gqa)  # (B, nh, T, hs)
    return linear(merge_heads(y, x), w, "self_attn.o_proj", lora)


def heads(t: torch.Tensor, n: int, hs: int, T: int) -> torch.Tensor:
    """A projection's output, (B·T, n·hs) or (B, T, n·hs), as n heads: (B, n, T, hs).

    The blocks run on their rows flattened, (B·T, C) (models.block_forward): a linear layer on a
    2-D input is one matmul, where a 3-D one also reshapes its input and output, two more
    operator calls for the host to issue per projection, and as many in the backward, for the
    same kernel on the same numbers. T is the RoPE table's length: cos (T, rot) or (B, 1, T, rot).
    """
    return t.view(-1, T, n, hs).transpose(1, 2)


def merge_heads(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Attention's output (B, n, T, hs) back as rows shaped as `like`'s: (B·T, n·hs) or
    (B, T, n·hs)."""
    return y.transpose(1, 2).reshape(*like.shape[:-1], y.shape[1] * y.shape[3])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs) → (B, nh, T, hs).

    `scale`: softmax scale (None: 1/sqrt(hs)); `window`: query t sees keys t-window+1..t (sliding
    window layers); `softcap`: scores → cap·tanh(scores/cap) before the mask (Gemma 2). Three
    kernels, fastest first: SDPA's causal fast path (no window shorter than T, no softcap);
    SDPA with an explicit boolean mask (a window shorter than T); scores written out in full,
    softmax in fp32 (softcap, which SDPA cannot take), as transformers' eager attention does.
    `mask`: a bool (B, 1, T, T) of what else may be seen (True: may), e.g. packed documents'
    same-document mask; it takes the masked paths. Or the block's KVCache (generating): the new
    keys and values join the cache's, and the cache says what each query sees (its window too).
    """
    T, gqa = q.shape[2], q.shape[1] != k.shape[1]
    if isinstance(mask, KVCache):
        k, v = mask.append(k, v)
        keep = mask.visible(window)  # (B, 1, T, keys so far)
    elif mask is None and softcap is None and (window is None or window >= T):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        i = torch.arange(T, device=q.device)
        keep = i[None, :] <= i[:, None]  # (T, T): key j ≤ query t
        if window is not None and window < T:
            keep = keep & (i[:, None] - i[None, :] < window)
        if mask is not None:
            keep = keep & mask  # (B, 1, T, T)
    if softcap is None:
        return masked_sdpa(q, k, v, keep, scale)
    k, v = repeat_kv(k, v, q.shape[1])
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap  # (B, nh, T, T)
    scores = scores.masked_fill(~keep, float("-inf"))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def repeat_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, nkv, T, hs) with each head repeated to `heads` heads: query head h reads key/value
    head h // (heads / nkv). Unchanged without grouped-query heads."""
    if k.shape[1] == heads:
        return k, v
    n = heads // k.shape[1]
    return k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale=None
) -> torch.Tensor:
    """SDPA with an explicit boolean mask (True: may attend). Grouped-query keys and values are
    repeated to the query heads first, as transformers does where it passes a mask: SDPA's
    enable_gqa runs only in its flash and math kernels on CUDA (torch 2.11's documentation), and
    flash takes no mask, so a masked GQA call would take the math kernel, which writes out fp32
    (B, nh, T, T) scores; with repeated heads the memory-efficient kernel takes it."""
    k, v = repeat_kv(k, v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up (SwiGLU). Without autograd (the streamed forward) in place, into `gate`: no
    temporaries. With autograd the out-of-place form: autograd would have to keep copies of what
    the in-place ops overwrite, which measured slower (docs/benchmarks.md)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return F.silu(gate) * up
    return F.silu(gate, inplace=True).mul_(up)


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor], lora: LoraContext | None) -> torch.Tensor:
    h = silu_mul(linear(x, w, "mlp.gate_proj", lora), linear(x, w, "mlp.up_proj", lora))
    return linear(h, w, "mlp.down_proj", lora)


def block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: ModelArgs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: LoraContext | None = None,
    mask=None,
) -> torch.Tensor:
    """One transformer block: (B·T, C) → (B·T, C), or (B, T, C) → (B, T, C) (see `heads`).
    `mask`: see `attention` (None: causal)."""
    x = x + attention(
        rms_norm(x, w["input_layernorm.weight"], args.rms_norm_eps), w, args, cos, sin, lora, mask
    )
    return x + mlp(rms_norm(x, w["post_attention_layernorm.weight"], args.rms_norm_eps), w, lora)


def embed(
    input_ids: torch.Tensor, g: dict[str, torch.Tensor], scale: float | None = None
) -> torch.Tensor:
    """(B, T) → (B, T, C); `scale` (ModelArgs.embed_scale, Gemma) multiplies in the weights'
    dtype, as transformers does (sqrt(3072) becomes 55.5 in bf16)."""
    w = g["model.embed_tokens.weight"]
    h = F.embedding(input_ids, w)
    return h if scale is None else h * torch.tensor(scale, dtype=w.dtype)


def lm_head_weight(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return g["lm_head.weight"] if "lm_head.weight" in g else g["model.embed_tokens.weight"]


def logits(h: torch.Tensor, g: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """Final norm + LM head (+ Gemma 2's soft cap): (B, T, C) → (B, T, vocab) in fp32."""
    h = rms_norm(h, g["model.norm.weight"], args.rms_norm_eps, args.norm_offset)
    lg = F.linear(h, lm_head_weight(g))
    if args.final_softcap is not None:  # in the compute dtype, as transformers does
        lg = torch.tanh(lg / args.final_softcap) * args.final_softcap
    return lg.float()


#: Logit values (positions × vocabulary) the head makes at once: its sequence is cut into chunks
#: of at most this many, so the fp32 logits and their softmax never exist for a whole micro-batch
#: (at T = 2048 and a 128k vocabulary those are 1 GiB each per row), and a big vocabulary does
#: not force activation offload by itself (memory.plan_memory counts one chunk).
#: the label of a position without loss (PyTorch cross_entropy's ignore_index)
IGNORE_INDEX = -100

HEAD_CHUNK_VALUES = 2**24


def head_chunks(h: torch.Tensor, vocab_size: int) -> list[slice]:
    """Slices of the sequence dimension of `h` (B, T, C) with ≤ HEAD_CHUNK_VALUES logits each."""
    B, T = h.shape[0], h.shape[1]
    step = max(1, HEAD_CHUNK_VALUES // max(1, B * vocab_size))
    return [slice(s, min(s + step, T)) for s in range(0, T, step)]


def loss_sum(
    h: torch.Tensor, labels: torch.Tensor, g: dict[str, torch.Tensor], args: ModelArgs
) -> torch.Tensor:
    """Summed next-token NLL (fp32) over positions whose label is not IGNORE_INDEX.

    `labels[b, t]` is the target for position t (already shifted by the data pipeline). Made
    chunk by chunk over the sequence (`head_chunks`): without grad only one chunk's logits exist
    at a time; with grad autograd keeps them all (the engine uses `loss_and_grad` instead).
    """
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for c in head_chunks(h, args.vocab_size):
        lg = logits(h[:, c], g, args)
        total = total + F.cross_entropy(
            lg.reshape(-1, lg.size(-1)), labels[:, c].reshape(-1), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )  # fmt: skip
    return total


def loss_and_grad(
    h: torch.Tensor,
    labels: torch.Tensor,
    g: dict[str, torch.Tensor],
    args: ModelArgs,
    denom: int,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum / denom, the gradient of `scale` × that w.r.t. `h`), one sequence chunk at a
    time: each chunk's logits are made, differentiated and freed before the next (the head's
    weights are frozen, so nothing else needs their graph). The gradient is in h's dtype, as
    autograd gives it; `scale` is fp16's loss scale (the loss returned is not scaled)."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad = torch.empty_like(h)
    for c in head_chunks(h, args.vocab_size):
        hc = h[:, c].detach().requires_grad_(True)
        part = loss_sum(hc, labels[:, c], g, args) / denom
        (part if scale == 1.0 else part * scale).backward()
        loss += part.detach()
        grad[:, c] = hc.grad
    return loss, grad
