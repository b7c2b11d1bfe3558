"""Mixture-of-experts in the plan: the share of a streamed block's experts expected to cross.

With expert-granular streaming (engine/expert_streaming.py) a streamed MoE block's copy holds
its dense part (attention, norms, router) and only the experts that at least one of the pass's
tokens was routed to: all the trainer's tokens of the step (every micro-batch routes before the
backward, whose prefetch copies the forward's union). Assuming uniform, independent routing
(each of T tokens picks k of E experts, each expert with probability k/E), an expert receives
no token with probability (1 − k/E)^T, so the expected share moved is

    share = 1 − (1 − k/E)^T

(Qwen3-30B-A3B, k = 8 of E = 128: 0.40 at T = 8 tokens, 0.87 at 32, 0.98 at 64, all but 3e-4
at 128: every step of a realistic size moves every expert under uniform routing). The formula
is the most that independent tokens can be expected to reach: 1 − (1 − p)^T is concave in an
expert's probability p, so skewed routers (popular experts) leave more experts idle, and so do
tokens that route alike (a tiny random Mixtral, 12 tokens, top 2 of 16: 0.55–0.68 measured
against 0.80, tests/plan/test_moe_plan.py). The plan's bytes are an upper bound in that
respect. A forward's copy of a block also holds the experts its previous step routed to (the
engine's prediction, engine/expert_streaming.py), and the misses come on demand: under the same
assumption 1 − (1 − s)² of them, while a backward's copy holds the forward's s; the plan's
bytes count the mean of the two per copy (the passes copy about as many blocks each). Blocks
stream by expert only where the
experts are stored apart (Qwen3-MoE, Mixtral, OLMoE) and the base is not quantized; others
cross whole (share 1).
"""

from __future__ import annotations

import math

from appliance.models import (
    active_blocks_param_count,
    blocks_param_count,
    expert_layout,
    param_count,
)
from appliance.models.hf_checkpoint import block_shapes
from appliance.models.layers import ModelArgs


def expected_share(tokens: int, top_k: int, experts: int) -> float:
    """1 − (1 − k/E)^T: the expected share of E experts that T tokens, each routed to k of them
    uniformly at random, leave with at least one token."""
    return 1.0 - (1.0 - top_k / experts) ** tokens


def streamed_by_expert(args: ModelArgs, base_quant: str) -> bool:
    """Whether the engine streams this model's blocks by expert (DeviceWeights `experts`)."""
    return expert_layout(args) is not None and base_quant == "none"


def expert_block_bytes(args: ModelArgs, dtype_bytes: int) -> int:
    """Bytes of one block's experts as uploaded (each tensor padded to 64 bytes)."""
    layout = expert_layout(args)
    names = set(layout.expert_weights(args))
    shapes = block_shapes(args, 0)
    return sum(
        -(-math.prod(s) * dtype_bytes // 64) * 64
        for n, s in shapes.items()
        if n.split(".", 3)[-1] in names
    )


def moe_share(args: ModelArgs, base_quant: str, tokens: int) -> dict | None:
    """The plan's MoE figures at `tokens` routed per block pass (one trainer's tokens a step):
    top_k, experts, the expected share moved, and the bytes a streamed block copy saves at it
    (per dtype byte: multiply by the compute dtype's size); None for a dense model."""
    if not args.num_experts:
        return None
    k, E = args.experts_per_token, args.num_experts
    by_expert = streamed_by_expert(args, base_quant)
    share = expected_share(tokens, k, E) if by_expert else 1.0
    per_copy = (1.0 - (1.0 - share) ** 2 + share) / 2  # a forward's (predicted) and a backward's
    return {
        "top_k": k,
        "experts": E,
        "routed_tokens_per_block_pass": tokens,
        "streamed_by_expert": by_expert,
        "expected_share": share,
        "expected_share_per_copy": per_copy,
        "uniform_share_formula": "1 - (1 - k/E)^T",
    }


def saved_bytes_per_copy(args: ModelArgs, dtype_bytes: int, share: float) -> int:
    """Bytes a streamed block copy does not move when `share` of its experts cross."""
    return round((1.0 - share) * expert_block_bytes(args, dtype_bytes))


def doctor_line(args: ModelArgs, base_quant: str, tokens: int) -> str:
    """`appliance doctor`'s line for a mixture of experts: the blocks' active parameters
    (attention, norms, router, k experts: what 6·N_active·T counts) against all of them, and the
    share of each streamed block's experts expected to cross at `tokens` a step."""
    m = moe_share(args, base_quant, tokens)
    active = active_blocks_param_count(args)
    head = (
        f"mixture of experts, top {m['top_k']} of {m['experts']}: a token meets "
        f"{active / 1e9:.3g}B of the blocks' {blocks_param_count(args) / 1e9:.3g}B parameters "
        f"({param_count(args) / 1e9:.3g}B with the embeddings and head); "
    )
    if not m["streamed_by_expert"]:
        return head + "streamed blocks cross whole (experts fused in one tensor, or quantized)"
    return head + (
        f"at {tokens} tokens a step, {m['expected_share']:.1%} of each streamed block's experts "
        "expected to cross (1 − (1 − k/E)^T, routing assumed uniform)"
    )
