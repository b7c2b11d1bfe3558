"""What one training step must compute: its FLOPs F (the speed floor's compute part) and the
least elementwise bytes it must move through the GPU's memory. The one definition; the engine's
step stats, `appliance bench` and `appliance plan` all count with it (docs/benchmarks.md, "The
floor").

F counts the matmul work of the streamed step (multiply-adds × 2), per micro-batch of `rows`
sequences of `seq_len` tokens (T = rows · seq_len tokens):

- blocks: the blocks' weights, 2·N·T a pass, N the parameters one token meets (a MoE block's
  router and its k experts: models.active_blocks_param_count); three passes for LoRA (forward,
  recompute, input gradient): 6·N·T; four for a full fine-tune (+ the weight gradients): 8·N·T.
- lora: the adapters, 2·n·T a pass, n = r·(in + out) over the adapted modules (a MoE block's
  k experts of its E); four passes (forward, recompute, input gradient, A's and B's gradients):
  8·n·T. None in a full fine-tune.
- attention: each softmax-attention block's QKᵀ and PV, 2·h·d per (query, key) pair each
  (h query heads of head size d, the block's own: Gemma 4's full blocks are wider), over the
  pairs causal attention must compute: t + 1 keys for query t, or min(t + 1, w) in a sliding
  window of w: forward, recompute, and a backward of twice the forward: ×4. A packed row counts
  as one causal sequence of its length.
- linear_attention: Qwen3.5's chunked delta rule (gated_deltanet.rule_flops), ×4 as attention.
- head: the LM head, forward and input gradient, 4·V·C·T; a full fine-tune that trains the head
  adds its weight gradient: 6·V·C·T. The loss itself (softmax, cross-entropy) is elementwise:
  counted in bytes, below, not in F.

Not in F: norms, RoPE, activations, residual adds, dropout, the loss: elementwise work, bounded by
memory bandwidth, not by the matmul rate. `elementwise_bytes` is its least traffic, reported as
its own line beside the floor (bytes / HBM bandwidth), never inside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from appliance.models import (
    active_blocks_param_count,
    block_linears,
    expert_modules,
    gated_deltanet,
    lora_modules,
    resolve_targets,
)
from appliance.models.layers import ModelArgs

#: rows × seq_len of each micro-batch of a step
Shapes = Iterable[tuple[int, int]]


@dataclass(frozen=True)
class StepFlops:
    """One step's FLOPs by part (module docstring); `total` is the F of the floor."""

    blocks: float = 0.0
    lora: float = 0.0
    attention: float = 0.0
    linear_attention: float = 0.0
    head: float = 0.0

    @property
    def total(self) -> float:
        return self.blocks + self.lora + self.attention + self.linear_attention + self.head

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def causal_pairs(seq_len: int, window: int | None = None) -> int:
    """(query, key) pairs causal attention over `seq_len` positions computes: Σₜ min(t + 1, w)."""
    T = seq_len
    if window is None or window >= T:
        return T * (T + 1) // 2
    return window * (window + 1) // 2 + (T - window) * window


def lora_active_params(args: ModelArgs, rank: int, targets: tuple[str, ...]) -> int:
    """r·(in + out) over the modules LoRA adapts, in every block, as one token meets them: a MoE
    block's expert adapters k times (its k experts), not E."""
    modules = set(lora_modules(resolve_targets(args, targets)))
    total = 0
    experts = expert_modules(args)  # this family's names for its experts' tensors
    for i in range(args.num_layers):
        for m in (*block_linears(args, i), *experts):
            if m in modules:
                k = args.experts_per_token if m in experts else 1
                total += rank * k * sum(args.module_shape(m, i))
    return total


def step_flops(
    args: ModelArgs,
    shapes: Shapes,
    *,
    lora_params: int = 0,
    full: bool = False,
    head_trained: bool = False,
) -> StepFlops:
    """F of one step over micro-batches of `shapes` ((rows, seq_len) each). `lora_params`:
    lora_active_params (0 for a full fine-tune); `full`: every weight trains (8·N·T);
    `head_trained`: a full fine-tune's LM head has a gradient (not when frozen with tied
    embeddings)."""
    shapes = list(shapes)
    tokens = sum(rows * T for rows, T in shapes)
    L, C, V = args.num_layers, args.hidden_size, args.vocab_size
    n = active_blocks_param_count(args)  # of a mixture of experts, the parameters a token meets
    attention = linear = 0.0
    for i in range(L):
        if args.layer_types and args.layer_types[i] == "linear_attention":
            linear += 4.0 * sum(gated_deltanet.rule_flops(args, rows * T) for rows, T in shapes)
            continue
        width = args.num_heads * args.attention_heads(i)[1]  # query heads × head size
        w = args.window(i)
        pairs = sum(rows * causal_pairs(T, w) for rows, T in shapes)
        attention += 4.0 * 4 * pairs * width  # (QKᵀ + PV) 2·2 a pair and dim, ×4 passes
    return StepFlops(
        blocks=(8.0 if full else 6.0) * n * tokens,
        lora=0.0 if full else 8.0 * lora_params * tokens,
        attention=attention,
        linear_attention=linear,
        head=(6.0 if full and head_trained else 4.0) * V * C * tokens,
    )


def elementwise_bytes(args: ModelArgs, shapes: Shapes, dtype_bytes: int) -> float:
    """The least bytes the step's elementwise work moves through device memory, each tensor read
    and written once, per pass (forward, recompute, backward: 3), per block and token: two norms
    (read and write C each), RoPE on q and k (read and write h·d + h_kv·d), the MLP's activation
    (read gate and up, write their product: 3·I, of the k active experts in a MoE block) and two
    residual adds (read 2·C, write C each), in the compute dtype; and the loss: fp32 logits
    written, read by the softmax and their gradient written (12·V a token). A floor for a fused
    step: a real one moves more (the backward reads saved tensors too, LoRA adds its own)."""
    tokens = sum(rows * T for rows, T in shapes)
    C = args.hidden_size
    inter = (
        args.experts_per_token * args.moe_intermediate_size
        if args.num_experts
        else args.intermediate_size
    )
    per_token = 0
    for i in range(args.num_layers):
        kv, d = args.attention_heads(i)
        per_token += 2 * 2 * C + 2 * (args.num_heads + kv) * d + 3 * inter + 2 * 3 * C
    return float(3 * per_token * dtype_bytes * tokens + 12 * args.vocab_size * tokens)
