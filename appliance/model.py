"""The Llama-family model math, in one file: shapes, RoPE, attention, MLP, LoRA, loss.

Everything here is a pure function of (activations, weights). Weights arrive as a dict of tensors
per transformer block, keyed by the Hugging Face names with the `model.layers.{i}.` prefix removed
(`self_attn.q_proj.weight`, `mlp.down_proj.weight`, `input_layernorm.weight`, ...), so the same
code runs on weights that stay resident and on weights streamed in from host memory.

Shapes: B batch, T sequence, C hidden size, nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3 parameters, sorted items
    attention_bias: bool = False  # bias on q, k, v (Qwen2, some Llamas)
    o_bias: bool = False  # bias on o_proj (Llama with attention_bias)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def module_shape(self, module: str) -> tuple[int, int]:
        """(out_features, in_features) of a block's linear module, e.g. `self_attn.q_proj`."""
        C, inter, hs = self.hidden_size, self.intermediate_size, self.head_dim
        return {
            "self_attn.q_proj": (self.num_heads * hs, C),
            "self_attn.k_proj": (self.num_kv_heads * hs, C),
            "self_attn.v_proj": (self.num_kv_heads * hs, C),
            "self_attn.o_proj": (C, self.num_heads * hs),
            "mlp.gate_proj": (inter, C),
            "mlp.up_proj": (inter, C),
            "mlp.down_proj": (C, inter),
        }[module]

    def block_param_count(self) -> int:
        n = sum(o * i for o, i in (self.module_shape(m) for m in TARGET_MODULES.values()))
        n += 2 * self.hidden_size  # two RMSNorm weights
        if self.attention_bias:
            n += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.o_bias:
            n += self.hidden_size
        if self.mlp_bias:
            n += 2 * self.intermediate_size + self.hidden_size
        return n

    def param_count(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.block_param_count() + embed + head + self.hidden_size


# ---------------------------------------------------------------- RoPE


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (hs/2,), fp32; llama3 scaling when configured."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if args.rope_scaling is None:
        return inv_freq
    p = dict(args.rope_scaling)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    args: ModelArgs, seq_len: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (T, hs) for positions 0..T-1, computed in fp32 then cast."""
    inv_freq = rope_inv_freq(args).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # (B, n, T, hs) * (T, hs) or (B, 1, T, hs)


def rope_at(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row RoPE tables (B, 1, T, hs) for `positions` (B, T), gathered from (T', hs) tables:
    packed documents restart their positions at 0."""
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalize in fp32 (as HF does), then scale in the compute dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class LoraContext:
    """What a block needs to apply LoRA: per-module (A, B) and how to drop out.

    `weights[module] = (A (r, in), B (out, r))` in the compute dtype. Dropout masks come from
    `generator`, seeded per (step, block, micro-batch) by the engine, so recomputing a block in
    backward draws exactly the masks its forward drew.
    """

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    dropout: float = 0.0
    generator: torch.Generator | None = None


def linear(
    x: torch.Tensor, w: dict[str, torch.Tensor], module: str, lora: LoraContext | None
) -> torch.Tensor:
    y = F.linear(x, w[f"{module}.weight"], w.get(f"{module}.bias"))
    if lora is not None and module in lora.weights:
        A, B = lora.weights[module]
        h = x
        if lora.dropout > 0:
            keep = 1.0 - lora.dropout
            mask = torch.empty_like(x).bernoulli_(keep, generator=lora.generator)
            h = x * mask / keep
        y = y + F.linear(F.linear(h, A), B) * lora.scale
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
    """Self-attention. `mask`: None (causal), a bool tensor (B, 1, T, T) from `document_mask`
    (packed documents, plain SDPA), or a flex_attention BlockMask (packed documents on CUDA)."""
    B, T, _ = x.shape
    hs = args.head_dim
    q = linear(x, w, "self_attn.q_proj", lora).view(B, T, args.num_heads, hs).transpose(1, 2)
    k = linear(x, w, "self_attn.k_proj", lora).view(B, T, args.num_kv_heads, hs).transpose(1, 2)
    v = linear(x, w, "self_attn.v_proj", lora).view(B, T, args.num_kv_heads, hs).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, nh|nkv, T, hs)
    gqa = args.num_kv_heads != args.num_heads
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif isinstance(mask, torch.Tensor):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        y = _flex_attention(q, k, v, mask, gqa)  # (B, nh, T, hs)
    y = y.transpose(1, 2).reshape(B, T, args.num_heads * hs)
    return linear(y, w, "self_attn.o_proj", lora)


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor], lora: LoraContext | None) -> torch.Tensor:
    gate = F.silu(linear(x, w, "mlp.gate_proj", lora))
    return linear(gate * linear(x, w, "mlp.up_proj", lora), w, "mlp.down_proj", lora)


def block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: ModelArgs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: LoraContext | None = None,
    mask=None,
) -> torch.Tensor:
    """One transformer block: (B, T, C) → (B, T, C). `mask`: see `attention` (None: causal)."""
    x = x + attention(
        rms_norm(x, w["input_layernorm.weight"], args.rms_norm_eps), w, args, cos, sin, lora, mask
    )
    return x + mlp(rms_norm(x, w["post_attention_layernorm.weight"], args.rms_norm_eps), w, lora)


def embed(input_ids: torch.Tensor, g: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.embedding(input_ids, g["model.embed_tokens.weight"])  # (B, T, C)


def lm_head_weight(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return g["lm_head.weight"] if "lm_head.weight" in g else g["model.embed_tokens.weight"]


def logits(h: torch.Tensor, g: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """Final norm + LM head: (B, T, C) → (B, T, vocab) in fp32."""
    h = rms_norm(h, g["model.norm.weight"], args.rms_norm_eps)
    return F.linear(h, lm_head_weight(g)).float()


def loss_sum(
    h: torch.Tensor, labels: torch.Tensor, g: dict[str, torch.Tensor], args: ModelArgs
) -> torch.Tensor:
    """Summed next-token NLL (fp32) over positions whose label is not -100.

    `labels[b, t]` is the target for position t (already shifted by the data pipeline).
    """
    lg = logits(h, g, args)
    return F.cross_entropy(
        lg.view(-1, lg.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
