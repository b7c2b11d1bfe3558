"""Model families: which architectures the appliance runs, and what each block holds.

A family is a module of pure functions and tables (see llama.py, qwen3.py, gemma.py, phi3.py):

- NORMS: the block's RMSNorm weights (hidden-sized), LINEARS: its linear modules (HF names);
- TARGETS: the LoRA target short names it has (and FUSED, for fused modules, the Llama
  targets each one stands for);
- block_forward(x, w, args, layer, cos, sin, lora, mask): one block, (B·T, C) → (B·T, C): the
  rows flattened (T: the RoPE table's length; layers.heads);
- a mixture of experts (qwen3_moe.py, olmoe.py, gpt_oss.py, qwen2_moe.py, qwen3_5_moe.py) also
  has MOE = True,
  DEFAULT_TARGETS (what the Llama default targets mean on it: the attention), extra_shapes(args)
  (router, experts, other tensors of its own), and its block_forward takes `router_logits`, a
  list it appends the router's logits to (the load-balancing loss); those whose checkpoints
  store each expert apart have layout(args) (moe.Layout: the experts' names; None where
  they are fused); one whose experts are not `mlp.experts.*` names their LoRA tensors in
  EXPERT_MODULES (Gemma 4, whose MoE block sits beside a dense MLP in the same family).

Everything here is keyed by the block's HF tensor names without the `model.layers.{i}.` prefix.
Attention kernels (layers.attention, layers.attend): Llama, Mistral, Qwen2, Qwen3 and Phi-3 run
SDPA's causal fast path; Gemma 3's sliding layers (and Phi-3 with a sliding_window) give SDPA an
explicit mask when the sequence is longer than the window; Gemma 2 soft-caps its scores, which
SDPA cannot do, and writes its scores out in full (softmax in fp32). See docs/models.md.

The package: layers.py (ModelArgs and the shared layers: RoPE, attention, MLP, LoRA'd linear,
loss), rope.py (the RoPE tables: scalings, cos/sin), attention.py, moe.py (the mixture-of-experts MLP: router, experts, load-balancing loss),
one file per family (llama, qwen3, gemma, phi3, qwen3_moe (also Mixtral), olmoe, gpt_oss,
qwen2_moe, qwen3_5 (+ gated_deltanet), qwen3_5_moe, gemma4;
multimodal.py for the text model inside image-text checkpoints), hf_config.py and hf_checkpoint.py (reading a Hugging Face
model directory), lora.py (adapter shapes and files, PEFT's format), presets.py (named shapes for
the plan and the bench). This file is the families' table and the block's tensor layout.
"""

from __future__ import annotations

import dataclasses
import math
import types

import torch

from appliance.errors import ConfigError
from appliance.models import (
    gated_deltanet,
    gemma,
    gemma4,
    gpt_oss,
    layers,
    llama,
    moe,
    olmoe,
    phi3,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
)

FAMILIES: dict[str, types.ModuleType] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "Qwen3ForCausalLM": qwen3,
    "Gemma2ForCausalLM": gemma,
    "Gemma3ForCausalLM": gemma,
    "Phi3ForCausalLM": phi3,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "MixtralForCausalLM": qwen3_moe,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "OlmoeForCausalLM": olmoe,
    "GptOssForCausalLM": gpt_oss,
    "Qwen3_5ForCausalLM": qwen3_5,
    "Qwen3_5MoeForCausalLM": qwen3_5_moe,
    "Gemma4ForCausalLM": gemma4,
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# LoRA target short name → the HF module it adapts, over every family
TARGETS = {
    **layers.TARGET_MODULES,
    "qkv": "self_attn.qkv_proj",
    "gate_up": "mlp.gate_up_proj",
    "experts": "mlp.experts",  # a MoE block's experts: both their tensors (EXPERT_MODULES)
    **gated_deltanet.TARGET_MODULES,  # Qwen3.5's linear attention: in_proj_qkv, ..., out_proj
    # a MoE block's shared expert (Qwen3.5-MoE; PEFT: gate_proj, up_proj, down_proj)
    **{f"shared_{m.split('.')[-1].removesuffix('_proj')}": m for m in moe.SHARED},
}
#: what LoRA on "experts" adapts: the experts' fused tensors, as PEFT's `target_parameters`
#: (`mlp.experts.*` in most families, Gemma 4's `experts.*`: `expert_modules` says which)
EXPERT_MODULES = (moe.GATE_UP, moe.DOWN, *gemma4.EXPERT_MODULES)


def experts_transposed(args: layers.ModelArgs) -> bool:
    """Whether a model's fused experts are stored (E, in, out) (gpt-oss), not (E, out, in)."""
    return family(args) is gpt_oss


def expert_modules(args: layers.ModelArgs) -> tuple[str, ...]:
    """The expert tensors LoRA on "experts" adapts in this model (none in a dense one)."""
    if not args.num_experts:
        return ()
    return getattr(family(args), "EXPERT_MODULES", (moe.GATE_UP, moe.DOWN))


def lora_modules(targets: tuple[str, ...]) -> list[str]:
    """The modules (and expert tensors) that LoRA targets (short names) adapt."""
    out: list[str] = []
    for t in targets:
        out += list(EXPERT_MODULES) if t == "experts" else [TARGETS[t]]
    return out


def lora_experts(args: layers.ModelArgs, module: str) -> int:
    """How many experts one LoRA module's A and B hold side by side: E for the experts' tensors
    (PEFT: A (r·E, in), B (out, r·E)), 1 for a linear module."""
    return args.num_experts if module in EXPERT_MODULES else 1


def family(args: layers.ModelArgs) -> types.ModuleType:
    return FAMILIES[args.architecture]


# ---------------------------------------------------------------- state across blocks
# Gemma 4 (models/gemma4.py) is the one family whose blocks share more than the residual
# stream: per-layer embeddings and KV-shared blocks. The engine makes one state per micro-batch
# (`block_state`), passes it to every block of that micro-batch, and backpropagates from the
# roots it gives (`backward_roots`); for every other family the state is None.

#: globals kept in host memory, gathered per step, never moved whole to the device
HOST_GLOBALS = (gemma4.PER_LAYER_TABLE,)


def has_block_state(args: layers.ModelArgs) -> bool:
    return family(args) is gemma4 and bool(args.per_layer_dim or args.num_kv_shared_layers)


def block_state(
    args: layers.ModelArgs,
    ids: torch.Tensor,
    g: dict[str, torch.Tensor],
    host: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
):
    """A micro-batch's state across blocks (None where the family has none). `ids` (B, T) as
    the data pipeline gives them (host memory), `g` the device globals, `host` HOST_GLOBALS."""
    if not has_block_state(args):
        return None
    per_layer = None
    if args.per_layer_dim:
        per_layer = gemma4.per_layer_inputs(
            ids, g, host[gemma4.PER_LAYER_TABLE], args, device, dtype
        )
    return gemma4.BlockState(per_layer)


def backward_roots(y: torch.Tensor, grad: torch.Tensor, state) -> tuple[list, list]:
    """(tensors, gradients) to backpropagate a recomputed block from: its output, and what the
    state adds (Gemma 4's store blocks: their K/V, with the gradients the reusing blocks gave)."""
    return ([y], [grad]) if state is None else state.roots(y, grad)


def state_bytes(args: layers.ModelArgs, B: int, T: int, dtype_bytes: int) -> int:
    """Device bytes one micro-batch's block state holds for the step: per-layer inputs and one
    K/V pair per shared layer type."""
    if not has_block_state(args):
        return 0
    n = args.num_layers * args.per_layer_dim
    if args.num_kv_shared_layers:
        for kind in set(args.layer_types[args.num_layers - args.num_kv_shared_layers :]):
            nkv, hs = args.attention_heads(gemma4.store_block(args, kind))
            n += 2 * nkv * hs
    return B * T * n * dtype_bytes


def _has_bias(args: layers.ModelArgs, module: str) -> bool:
    if module == "self_attn.o_proj":
        return args.o_bias
    return args.attention_bias if module.startswith("self_attn.") else args.mlp_bias


def block_linears(args: layers.ModelArgs, layer: int = 0) -> tuple[str, ...]:
    """Block `layer`'s linear modules, in the order it calls them: the family's LINEARS, or,
    where blocks differ by kind (Qwen3.5's linear and full attention), its `linears`."""
    fam = family(args)
    return fam.linears(args, layer) if hasattr(fam, "linears") else fam.LINEARS


def block_shapes(args: layers.ModelArgs, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Every tensor of block `layer` (names without the layer prefix) with the shape config.json
    implies, in checkpoint order: norms, q/k head norms, then each linear's weight and bias.
    The same for every block but in families whose blocks differ by kind, which give their own
    (`block_shapes(args, layer)`: Qwen3.5)."""
    fam = family(args)
    if hasattr(fam, "block_shapes"):
        return fam.block_shapes(args, layer)
    out: dict[str, tuple[int, ...]] = {f"{n}.weight": (args.hidden_size,) for n in fam.NORMS}
    if args.qk_norm:
        out["self_attn.q_norm.weight"] = (args.head_dim,)
        out["self_attn.k_norm.weight"] = (args.head_dim,)
    for module in fam.LINEARS:
        rows, cols = args.module_shape(module)
        out[f"{module}.weight"] = (rows, cols)
        if _has_bias(args, module):
            out[f"{module}.bias"] = (rows,)
    if hasattr(fam, "extra_shapes"):  # a MoE family's router and experts, OLMoE's q/k norms
        out.update(fam.extra_shapes(args))
    return out


def linear_weight_names(args: layers.ModelArgs, layer: int = 0) -> list[str]:
    """The weights of block `layer`'s linear projections, fused ones included (what quantization
    covers): e.g. `self_attn.q_proj.weight`, or Phi-3's `self_attn.qkv_proj.weight`."""
    layout = expert_layout(args)
    experts = layout.expert_weights(args) if layout is not None else []
    return [f"{module}.weight" for module in block_linears(args, layer)] + experts


def expert_layout(args: layers.ModelArgs) -> moe.Layout | None:
    """Where a MoE model's block keeps its router and experts stored apart (None: a dense
    model, or experts fused in 3-D tensors)."""
    fam = family(args)
    return fam.layout(args) if hasattr(fam, "layout") else None


def takes_block_mask(args: layers.ModelArgs) -> bool:
    """Whether the family's attention is layers.attention, which takes a flex_attention BlockMask
    for packed documents on CUDA (the Llama family); the others go through layers.attend, which
    takes a boolean mask."""
    return family(args) is llama


def block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None = None,
    mask: torch.Tensor | None = None,
    layer: int = 0,
    router_logits: list | None = None,
    state=None,
) -> torch.Tensor:
    """Block `layer` of the model's family: (B, T, C) → (B, T, C). cos/sin: the table that block
    takes (ModelArgs.local_rope); `mask`: see layers.attend (None: causal). The family's block runs
    on the rows flattened, (B·T, C): fewer operator calls (layers.heads). `router_logits`: a list
    a MoE block appends its router's logits (B·T, E) to (the load-balancing loss); `state`: the
    micro-batch's `block_state` (Gemma 4)."""
    B, T, C = x.shape
    extra: dict = {} if state is None else {"state": state}
    if router_logits is not None and args.num_experts:
        extra["router_logits"] = router_logits
    y = family(args).block_forward(
        x.reshape(B * T, C), w, args, layer, cos, sin, lora, mask, **extra
    )
    return y.view(B, T, C)


_compiled = None


def compiled_block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    args: layers.ModelArgs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: layers.LoraContext | None = None,
    mask: torch.Tensor | None = None,
    layer: int = 0,
    router_logits: list | None = None,
    state=None,
) -> torch.Tensor:
    """`block_forward` through torch.compile (Inductor: the block's elementwise work fused into
    generated kernels, fewer launches): the engine's `compile_blocks`. The same math, rounded
    differently where Inductor fuses (not bitwise equal to the eager block; tests/
    test_compiled_blocks.py holds it to the eager block's parity tolerance).

    Compiled once per kind of layer, not once per layer: `layer` only selects the block's
    attention window (ModelArgs.window), so it is replaced by the first layer with the same
    window, and Dynamo specialises on at most two values (Gemma's sliding and full layers).
    LoRA dropout's masks are drawn before the compiled block runs (`dropout_masks`), so it
    compiles whole with dropout too. A block with a state across blocks (Gemma 4) runs eager,
    and so does a mixture-of-experts block (`compile_blocks_note`).
    """
    global _compiled
    if state is not None or args.num_experts:
        return block_forward(x, w, args, cos, sin, lora, mask, layer, router_logits, state)
    if _compiled is None:
        _compiled = torch.compile(block_forward)
    if lora is not None and lora.dropout > 0 and lora.masks is None:
        lora = dataclasses.replace(lora, masks=dropout_masks(x, args, lora, layer))
    kind = first_layer_like(args, layer)
    return _compiled(x, w, args, cos, sin, lora, mask, layer=kind, router_logits=router_logits)


def compile_blocks_note(args: layers.ModelArgs) -> str | None:
    """What `--compile-blocks` does not compile in this model (None: every block compiles). A
    mixture of experts' blocks run eager: the loop over the experts that received rows has
    data-dependent shapes and a host sync (which experts; expert-granular streaming copies them
    in), which break Dynamo's graph at every expert and recompile per row count."""
    if args.num_experts:
        return (
            "--compile-blocks: the mixture-of-experts blocks run eager (the loop over the "
            "experts routed to has data-dependent shapes, which torch.compile would break and "
            "recompile at every expert); nothing is compiled in this model"
        )
    return None


def dropout_masks(
    x: torch.Tensor, args: layers.ModelArgs, lora: layers.LoraContext, layer: int = 0
) -> dict[str, torch.Tensor]:
    """The LoRA dropout masks the eager block draws, one per adapted projection, drawn here
    instead: from the same generator, in the order the block calls its projections (the
    family's LINEARS), each shaped as that projection's input rows, so the compiled block drops
    exactly what the eager one does. Inside it, the seeded `bernoulli_` would break Dynamo's
    graph at every projection (it cannot trace a Generator)."""
    rows, keep = x.numel() // x.shape[-1], 1.0 - lora.dropout
    return {
        m: x.new_empty(rows, args.module_shape(m, layer)[1]).bernoulli_(
            keep, generator=lora.generator
        )
        for m in block_linears(args, layer)
        if m in lora.weights
    }


def first_layer_like(args: layers.ModelArgs, layer: int) -> int:
    """The first block whose attention window and layer type are block `layer`'s
    (ModelArgs.window, ModelArgs.layer_types: Qwen3.5's linear and full layers)."""

    def kind(i: int) -> tuple:
        return args.window(i), args.layer_types[i] if args.layer_types else None

    return next(i for i in range(args.num_layers) if kind(i) == kind(layer))


def resolve_targets(args: layers.ModelArgs, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The LoRA targets `targets` (short names) mean on this model, in the family's order.

    On a fused family (Phi-3) the Llama names of all the parts of a fused module stand for it
    (q,k,v → qkv; gate,up → gate_up): the default targets work on every family. Naming only
    some parts is refused: the parts cannot be adapted apart.
    """
    fam = family(args)
    if "experts" in targets and not args.num_experts:
        raise ConfigError(
            f"--lora-targets experts: {args.architecture} here has no experts (a dense model)"
        )
    if hasattr(fam, "DEFAULT_TARGETS") and set(targets) == set(layers.TARGET_MODULES):
        return fam.DEFAULT_TARGETS  # the Llama defaults: a MoE block's attention (qwen3_moe)
    fused = getattr(fam, "FUSED", {})
    wanted = {t for t in targets if t in fam.TARGETS}
    for whole, parts in fused.items():
        given = [p for p in parts if p in targets]
        if given and len(given) < len(parts):
            raise ConfigError(
                f"--lora-targets {','.join(given)}: {args.architecture} fuses "
                f"{','.join(parts)} into one module ({TARGETS[whole]}); name all of them or "
                f"'{whole}'"
            )
        if given:
            wanted.add(whole)
    parts_of_fused = {p for parts in fused.values() for p in parts}
    unknown = [t for t in targets if t not in fam.TARGETS and t not in parts_of_fused]
    if unknown:
        raise ConfigError(
            f"--lora-targets {','.join(unknown)}: {args.architecture} has no such module; "
            f"its targets are {','.join(fam.TARGETS)}"
        )
    return tuple(t for t in fam.TARGETS if t in wanted)


def global_shapes(args: layers.ModelArgs) -> dict[str, tuple[int, ...]]:
    """Tensors outside the blocks that a family adds to the embeddings, final norm and head
    (Gemma 4's per-layer embeddings), with their shapes."""
    fam = family(args)
    return fam.global_shapes(args) if hasattr(fam, "global_shapes") else {}


def block_param_count(args: layers.ModelArgs, layer: int | None = None) -> int:
    """Parameters in block `layer`: every tensor block_shapes lists; None: the biggest block
    (the blocks of a family differ only where their kinds do: Qwen3.5)."""
    if layer is None:
        return max(block_param_count(args, i) for i in range(args.num_layers))
    return sum(math.prod(shape) for shape in block_shapes(args, layer).values())


def blocks_param_count(args: layers.ModelArgs) -> int:
    """Parameters in all the blocks."""
    return sum(block_param_count(args, i) for i in range(args.num_layers))


def active_block_param_count(args: layers.ModelArgs) -> int:
    """Parameters one token meets in one block: all of a dense block's; of a MoE block's, the
    attention, the norms, the router and its k experts (not the E − k others)."""
    total = block_param_count(args)
    if not args.num_experts:
        return total
    expert = 3 * args.hidden_size * args.moe_intermediate_size  # gate, up, down
    return total - (args.num_experts - args.experts_per_token) * expert


def active_blocks_param_count(args: layers.ModelArgs) -> int:
    """Parameters one token meets over all the blocks (`active_block_param_count` summed over
    blocks that differ by kind: Qwen3.5-MoE's linear and full attention)."""
    if not args.num_experts:
        return blocks_param_count(args)
    idle = (args.num_experts - args.experts_per_token) * 3 * args.hidden_size
    return blocks_param_count(args) - args.num_layers * idle * args.moe_intermediate_size


def param_count(args: layers.ModelArgs) -> int:
    """Parameters of the whole model: the blocks, the embedding, the head (unless tied), the
    final norm."""
    embed = args.vocab_size * args.hidden_size
    head = 0 if args.tie_word_embeddings else embed
    extra = sum(math.prod(shape) for shape in global_shapes(args).values())
    return blocks_param_count(args) + embed + head + args.hidden_size + extra
