"""Model families: which architectures the appliance runs, and what each block holds.

A family is a module of pure functions and tables (see llama.py, qwen3.py, gemma.py, phi3.py):

- NORMS: the block's RMSNorm weights (hidden-sized), LINEARS: its linear modules (HF names);
- TARGETS: the LoRA target short names it has (and FUSED, for fused modules, the Llama
  targets each one stands for);
- block_forward(x, w, args, layer, cos, sin, lora, mask): one block, (B·T, C) → (B·T, C): the
  rows flattened (T: the RoPE table's length; layers.heads).

Everything here is keyed by the block's HF tensor names without the `model.layers.{i}.` prefix.
Attention kernels (layers.attention, layers.attend): Llama, Mistral, Qwen2, Qwen3 and Phi-3 run
SDPA's causal fast path; Gemma 3's sliding layers (and Phi-3 with a sliding_window) give SDPA an
explicit mask when the sequence is longer than the window; Gemma 2 soft-caps its scores, which
SDPA cannot do, and writes its scores out in full (softmax in fp32). See docs/models.md.

The package: layers.py (ModelArgs and the shared layers: RoPE, attention, MLP, LoRA'd linear,
loss), attention.py, one file per family (llama, qwen3, gemma, phi3; multimodal.py for the text
model inside image-text checkpoints), hf_config.py and hf_checkpoint.py (reading a Hugging Face
model directory), lora.py (adapter shapes and files, PEFT's format), presets.py (named shapes for
the plan and the bench). This file is the families' table and the block's tensor layout.
"""

from __future__ import annotations

import dataclasses
import math
import types

import torch

from appliance.errors import ConfigError
from appliance.models import gated_deltanet, gemma, layers, llama, phi3, qwen3, qwen3_5

FAMILIES: dict[str, types.ModuleType] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "Qwen3ForCausalLM": qwen3,
    "Gemma2ForCausalLM": gemma,
    "Gemma3ForCausalLM": gemma,
    "Phi3ForCausalLM": phi3,
    "Qwen3_5ForCausalLM": qwen3_5,
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# LoRA target short name → the HF module it adapts, over every family
TARGETS = {
    **layers.TARGET_MODULES,
    "qkv": "self_attn.qkv_proj",
    "gate_up": "mlp.gate_up_proj",
    **gated_deltanet.TARGET_MODULES,  # Qwen3.5's linear attention: in_proj_qkv, ..., out_proj
}


def family(args: layers.ModelArgs) -> types.ModuleType:
    return FAMILIES[args.architecture]


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
    return out


def linear_weight_names(args: layers.ModelArgs, layer: int = 0) -> list[str]:
    """The weights of block `layer`'s linear projections, fused ones included (what quantization
    covers): e.g. `self_attn.q_proj.weight`, or Phi-3's `self_attn.qkv_proj.weight`."""
    return [f"{module}.weight" for module in block_linears(args, layer)]


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
) -> torch.Tensor:
    """Block `layer` of the model's family: (B, T, C) → (B, T, C). cos/sin: the table that block
    takes (ModelArgs.local_rope); `mask`: see layers.attend (None: causal). The family's block runs
    on the rows flattened, (B·T, C): fewer operator calls (layers.heads)."""
    B, T, C = x.shape
    y = family(args).block_forward(x.reshape(B * T, C), w, args, layer, cos, sin, lora, mask)
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
) -> torch.Tensor:
    """`block_forward` through torch.compile (Inductor: the block's elementwise work fused into
    generated kernels, fewer launches): the engine's `compile_blocks`. The same math, rounded
    differently where Inductor fuses (not bitwise equal to the eager block; tests/
    test_compiled_blocks.py holds it to the eager block's parity tolerance).

    Compiled once per kind of layer, not once per layer: `layer` only selects the block's
    attention window (ModelArgs.window), so it is replaced by the first layer with the same
    window, and Dynamo specialises on at most two values (Gemma's sliding and full layers).
    LoRA dropout's masks are drawn before the compiled block runs (`dropout_masks`), so it
    compiles whole with dropout too."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(block_forward)
    if lora is not None and lora.dropout > 0 and lora.masks is None:
        lora = dataclasses.replace(lora, masks=dropout_masks(x, args, lora))
    kind = first_layer_like(args, layer)
    return _compiled(x, w, args, cos, sin, lora, mask, layer=kind)


def dropout_masks(
    x: torch.Tensor, args: layers.ModelArgs, lora: layers.LoraContext
) -> dict[str, torch.Tensor]:
    """The LoRA dropout masks the eager block draws, one per adapted projection, drawn here
    instead: from the same generator, in the order the block calls its projections (the
    family's LINEARS), each shaped as that projection's input rows, so the compiled block drops
    exactly what the eager one does. Inside it, the seeded `bernoulli_` would break Dynamo's
    graph at every projection (it cannot trace a Generator)."""
    rows, keep = x.numel() // x.shape[-1], 1.0 - lora.dropout
    return {
        m: x.new_empty(rows, args.module_shape(m)[1]).bernoulli_(keep, generator=lora.generator)
        for m in family(args).LINEARS  # (Qwen3.5's: every kind's, in each kind's order)
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


def block_param_count(args: layers.ModelArgs, layer: int | None = None) -> int:
    """Parameters in block `layer`: every tensor block_shapes lists; None: the biggest block
    (the blocks of a family differ only where their kinds do: Qwen3.5)."""
    if layer is None:
        return max(block_param_count(args, i) for i in range(args.num_layers))
    return sum(math.prod(shape) for shape in block_shapes(args, layer).values())


def blocks_param_count(args: layers.ModelArgs) -> int:
    """Parameters in all the blocks."""
    return sum(block_param_count(args, i) for i in range(args.num_layers))


def param_count(args: layers.ModelArgs) -> int:
    """Parameters of the whole model: the blocks, the embedding, the head (unless tied), the
    final norm."""
    embed = args.vocab_size * args.hidden_size
    head = 0 if args.tie_word_embeddings else embed
    return blocks_param_count(args) + embed + head + args.hidden_size
