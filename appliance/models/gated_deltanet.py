"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3.6, Qwen3-Next), as pure functions.

A linear-attention layer of Qwen3.5 (transformers' Qwen3_5GatedDeltaNet), on x (B·T, C):

1. projections: `in_proj_qkv` (q, k, v one after the other), `in_proj_z` (the output gate),
   `in_proj_b` (β, the write strength, through a sigmoid) and `in_proj_a` (the decay's input);
2. a short causal depthwise convolution over q, k, v along the sequence (kernel 4, no bias), then
   SiLU (`causal_conv`);
3. the gated delta rule (`gated_delta_rule`): per value head a state S (dk, dv) that decays by
   exp(g_t) at each token (g_t = -exp(A_log)·softplus(a_t + dt_bias) ≤ 0), then is corrected
   toward v_t for key k_t with strength β_t (S += k_t ((v_t − Sᵀk_t)·β_t)ᵀ), and read by q_t
   (q and k L2-normalized, q scaled by dk^-1/2). Key heads serve nv / nk consecutive value heads;
4. an RMSNorm of each head's output gated by SiLU(z) (`gated_rms_norm`), then `out_proj`.

The rule runs in its chunked form (`chunk_gated_delta_rule`, transformers' torch algorithm, chunks
of 64 tokens: the within-chunk part as matrix products and one triangular solve, a sequential scan
over chunks), which autograd differentiates for the recompute + backward. On CUDA the
flash-linear-attention kernel takes its place where the `fla` package imports
(`fla_chunk_rule`); the torch form is the fallback and the reference.

Packed documents: no state crosses a document boundary, neither the convolution's nor the
recurrence's. The engine passes packed rows to a block as a same-document attention mask
(layers.document_mask); `document_starts` reads where each document starts from it, and the layer
runs on the documents laid out as a padded batch of their own (`Documents`): each document from
position 0 of its row, zeros after its end (a causal layer never reads the padding into a real
position). Plain rows are one document each and run as they are.

Shapes: N = B·T rows, D documents of at most L tokens, nk/nv key/value heads of dk/dv dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.models import layers

LINEARS = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.out_proj",
)
# LoRA target short names (PEFT's module names) → modules
TARGET_MODULES = {m.split(".")[-1]: m for m in LINEARS}

#: tokens per chunk of the chunked rule (transformers' and fla's default)
CHUNK = 64


def shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """The layer's tensors that are not linear weights (names under the block), with shapes."""
    conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim + (
        args.linear_num_value_heads * args.linear_value_head_dim
    )
    nv = args.linear_num_value_heads
    return {
        "linear_attn.conv1d.weight": (conv_dim, 1, args.linear_conv_kernel),
        "linear_attn.dt_bias": (nv,),
        "linear_attn.A_log": (nv,),
        "linear_attn.norm.weight": (args.linear_value_head_dim,),
    }


def rule_flops(args: layers.ModelArgs, tokens: int) -> float:
    """Forward FLOPs of the chunked rule over `tokens` tokens in one layer (not counted by
    6·N·T: they scale with the chunk, not with parameters). Per token and value head, chunk c:
    q·kᵀ and (βk)·kᵀ within the chunk (2·c·dk), the two triangular solves (c·(dk + dv)), the
    within-chunk read (c·dv), and the state's read, correction and update (3·dk·dv); ×2 for
    multiply-adds."""
    c, dk, dv = CHUNK, args.linear_key_head_dim, args.linear_value_head_dim
    per_head = 2 * (2 * c * dk + c * (dk + dv) + c * dv + 3 * dk * dv)
    return float(tokens * args.linear_num_value_heads * per_head)


def work_bytes(args: layers.ModelArgs, tokens: int) -> int:
    """Device bytes the chunked rule holds for the backward of one micro-batch of `tokens`
    tokens through one layer, in fp32: four (tokens, c) matrices per value head (decays, the
    system, the within-chunk scores, the solve's output) and q, k, v and what is derived from
    them (βk, βv, the solves' results) at their head sizes."""
    h, dk, dv = args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim
    return tokens * h * (4 * CHUNK + 3 * dk + 3 * dv) * 4


# ---------------------------------------------------------------- packed documents


def document_starts(mask: torch.Tensor | None, B: int, T: int) -> torch.Tensor | None:
    """(B, T) bool, True where a document starts, from a same-document mask (B, 1, T, T)
    (layers.document_mask): token t starts one where it may not see token t − 1. None (plain
    rows, one document each) for no mask."""
    if mask is None:
        return None
    sees_previous = mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # (B, T-1): t+1 sees t
    first = torch.ones(B, 1, dtype=torch.bool, device=mask.device)
    return torch.cat((first, ~sees_previous), dim=1)


class Documents:
    """Packed rows laid out as a padded batch of documents and back (see the module docstring):
    `unpack` (N, F) → (D, L, F), zeros after each document's end; `pack` the inverse on the real
    positions. Both are an index copy and a gather: autograd goes through them."""

    def __init__(self, starts: torch.Tensor):
        flat = starts.reshape(-1)
        n = flat.numel()
        doc = flat.long().cumsum(0) - 1  # (N,) the document of each row
        first = flat.nonzero().squeeze(1)  # (D,) where each starts
        offset = torch.arange(n, device=flat.device) - first[doc]
        self.count = int(first.numel())
        self.length = int(torch.diff(first, append=first.new_tensor([n])).max())
        self.slot = doc * self.length + offset  # (N,) position in the padded (D·L) layout

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.count * self.length, x.shape[-1]).index_copy(0, self.slot, x)
        return out.view(self.count, self.length, x.shape[-1])

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(self.count * self.length, -1).index_select(0, self.slot)


# ---------------------------------------------------------------- the parts


def causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of x (D, L, channels) along L with `weight`
    (channels, 1, K): output t sees inputs t−K+1..t of its own channel (zeros before 0)."""
    K, L = weight.shape[-1], x.shape[1]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, padding=K - 1, groups=x.shape[-1])
    return F.silu(y[..., :L]).transpose(1, 2).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dimension (as fla and transformers compute it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of x (…, dv) scaled by w (Llama's order: normalized in fp32, cast, times w), then
    times SiLU(gate) in fp32 (transformers' Qwen3_5RMSNormGated)."""
    dtype = x.dtype
    h = weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The gated delta rule from a zero state, chunked (transformers' torch_chunk_gated_delta_rule,
    fp32 inside): q, k (D, L, h, dk) already L2-normalized and repeated to the value heads, v
    (D, L, h, dv), g and beta (D, L, h) → (D, L, h, dv) in v's dtype."""
    dtype = v.dtype
    D, L, h, dk = k.shape
    q, k, v, beta, g = (t.transpose(1, 2).float() for t in (q, k, v, beta, g))  # (D, h, L, …)
    q = q * dk**-0.5
    pad = (chunk - L % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (L + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(D, h, n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(D, h, n, chunk).cumsum(dim=-1)  # log of the decay since the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay from position j to i of a chunk (i ≥ j); 0 above the diagonal
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    # the within-chunk delta-rule updates, condensed by one unit-triangular solve (the UT form)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = q.new_zeros(D, h, dk, v.shape[-1])
    out = []
    for i in range(n):  # the sequential scan over chunks
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(D, h, n * chunk, -1)[:, :, :L]
    return o.transpose(1, 2).to(dtype)


_FLA: object = None  # fla's chunk_gated_delta_rule; False: not importable


def fla_chunk_rule():
    """flash-linear-attention's chunked gated delta rule (CUDA), or None where `fla` does not
    import (the torch form runs then)."""
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as rule
        except Exception:  # noqa: BLE001 - not installed, or no Triton/CUDA: the torch form runs
            rule = False
        _FLA = rule
    return _FLA or None


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The rule on raw q, k (D, L, nk, dk), v (D, L, nv, dv), g, beta (D, L, nv): L2-normalizes
    q and k, repeats them to the value heads, and runs fla's kernel on CUDA where it imports,
    else `chunk_gated_delta_rule`. → (D, L, nv, dv) in v's dtype."""
    nk, nv = k.shape[2], v.shape[2]
    q, k = l2norm(q.float()), l2norm(k.float())
    if nk != nv:
        q, k = q.repeat_interleave(nv // nk, dim=2), k.repeat_interleave(nv // nk, dim=2)
    rule = fla_chunk_rule() if v.is_cuda else None
    if rule is not None:
        o, _ = rule(q.to(v.dtype), k.to(v.dtype), v, g.float(), beta.to(v.dtype),
                    scale=k.shape[-1] ** -0.5)  # fmt: skip
        return o.to(v.dtype)
    return chunk_gated_delta_rule(q, k, v, g, beta)


# ---------------------------------------------------------------- the layer


def linear_attention(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    lora: layers.LoraContext | None,
    T: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Gated DeltaNet layer on x (B·T, C) → (B·T, C), rows of T tokens; `mask`: the packed
    documents' mask (None: plain rows)."""
    B = x.shape[0] // T
    nk, nv = args.linear_num_key_heads, args.linear_num_value_heads
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    qkv = layers.linear(x, w, "linear_attn.in_proj_qkv", lora)  # (N, 2·nk·dk + nv·dv)
    z = layers.linear(x, w, "linear_attn.in_proj_z", lora)  # (N, nv·dv)
    b = layers.linear(x, w, "linear_attn.in_proj_b", lora)  # (N, nv)
    a = layers.linear(x, w, "linear_attn.in_proj_a", lora)
    starts = document_starts(mask, B, T)
    docs = Documents(starts) if starts is not None else None
    # what runs along the sequence: q, k, v (convolved) and the gates, one row per token
    seq = torch.cat((qkv, b, a), dim=-1)
    seq = docs.unpack(seq) if docs is not None else seq.view(B, T, -1)
    qkv, b, a = seq.split((qkv.shape[-1], nv, nv), dim=-1)
    qkv = causal_conv(qkv, w["linear_attn.conv1d.weight"])
    q, k, v = qkv.split((nk * dk, nk * dk, nv * dv), dim=-1)
    D, L = qkv.shape[:2]
    beta = b.sigmoid()
    g = -w["linear_attn.A_log"].float().exp() * F.softplus(a.float() + w["linear_attn.dt_bias"])
    o = gated_delta_rule(
        q.reshape(D, L, nk, dk), k.reshape(D, L, nk, dk), v.reshape(D, L, nv, dv), g, beta
    )  # (D, L, nv, dv)
    o = docs.pack(o) if docs is not None else o.reshape(B * T, nv * dv)
    o = gated_rms_norm(
        o.reshape(-1, dv), z.reshape(-1, dv), w["linear_attn.norm.weight"], args.rms_norm_eps
    )
    return layers.linear(o.reshape(B * T, nv * dv), w, "linear_attn.out_proj", lora)
