"""Benchmark presets: real models' shapes (Llama 2/3, Qwen3, Gemma 2/3, Phi-4-mini, Qwen3.6,
Gemma 4, and the mixtures of experts Qwen3-30B-A3B, gpt-oss-20b and Qwen3.6-35B-A3B) and the
tokens of a step, for `appliance bench` (random weights of these shapes) and `appliance plan`.

Each preset's ModelArgs is what hf_checkpoint.read_model_args would read from the released
model's config.json (tests/bench/test_bench.py checks the parameter counts against the published ones).
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.models.layers import ModelArgs


def _family(
    arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, hs: int, **kw
) -> ModelArgs:
    """The shape of a newer family's model (config.json's fields, as hf_checkpoint reads them)."""
    return ModelArgs(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hs,
        rms_norm_eps=kw.pop("rms_norm_eps", 1e-6),
        rope_theta=kw.pop("rope_theta", 10000.0),
        max_position_embeddings=kw.pop("max_position_embeddings", 8192),
        **kw,
    )


def _llama(
    vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, **kw
) -> ModelArgs:
    """A Llama shape: heads of hidden/heads dimensions, Llama 2's eps and context unless given."""
    kw.setdefault("rms_norm_eps", 1e-5)
    kw.setdefault("max_position_embeddings", 4096)
    return _family(
        "LlamaForCausalLM", vocab, hidden, inter, layers, heads, kv, hidden // heads, **kw
    )


def _gemma(arch: str, *shape: int, window: int, pattern: int, **kw) -> ModelArgs:
    layers = shape[3]
    types = tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    )
    return _family(
        arch, *shape,
        norm_offset=1.0, embed_scale=shape[1] ** 0.5,
        attn_scale=256**-0.5, sliding_window=window, layer_types=types, tie_word_embeddings=True,
        **kw,
    )  # fmt: skip


def _hybrid(layers: int, interval: int) -> tuple[str, ...]:
    """Qwen3.5's layer types: every `interval`-th layer full attention, the others linear."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    )


_LONGROPE_48 = (
    ("long_factor", (1.0,) * 48),  # placeholders: a step's time does not depend on the values
    ("original_max_position_embeddings", 4096.0),
    ("rope_type", "longrope"),
    ("short_factor", (1.0,) * 48),
)


_YARN_32 = (  # gpt-oss's rope_parameters, as hf_config reads them
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("factor", 32.0),
    ("original_max_position_embeddings", 4096.0),
    ("rope_type", "yarn"),
    ("truncate", False),
)


@dataclass(frozen=True)
class Shape:
    """Tokens of one step: micro_batches × micro_batch_size × seq_len, and how many steps."""

    micro_batch_size: int
    seq_len: int
    micro_batches: int
    steps: int  # timed steps (after `warmup` untimed ones)
    warmup: int = 1


@dataclass(frozen=True)
class Preset:
    args: ModelArgs
    gpu: Shape
    cpu: Shape | None  # None: refused on CPU (too big to be useful there)


_GPU_SHAPE = Shape(micro_batch_size=1, seq_len=2048, micro_batches=8, steps=3)
PRESETS: dict[str, Preset] = {
    # runs in seconds on a CPU
    "tiny": Preset(
        _llama(2048, 256, 688, 4, 4, 2),
        gpu=Shape(2, 128, 4, 3),
        cpu=Shape(2, 128, 4, 3),
    ),
    # Llama-3.2-1B: GQA, llama3 RoPE, tied embeddings, 128k vocabulary
    "1b": Preset(
        _llama(
            128256, 2048, 8192, 16, 32, 8,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling=(
                ("factor", 32.0),
                ("high_freq_factor", 4.0),
                ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 8192.0),
            ),
            tie_word_embeddings=True,
        ),
        gpu=_GPU_SHAPE,
        cpu=Shape(1, 128, 2, 1),
    ),
    # Llama-2 shapes
    "7b": Preset(_llama(32000, 4096, 11008, 32, 32, 32), gpu=_GPU_SHAPE, cpu=None),
    "13b": Preset(_llama(32000, 5120, 13824, 40, 40, 40), gpu=_GPU_SHAPE, cpu=None),
    "70b": Preset(_llama(32000, 8192, 28672, 80, 64, 8), gpu=_GPU_SHAPE, cpu=None),
    # the newer families at their released shapes (config.json of each)
    "qwen3-8b": Preset(
        _family("Qwen3ForCausalLM", 151936, 4096, 12288, 36, 32, 8, 128,
                rope_theta=1e6, max_position_embeddings=40960, qk_norm=True),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # soft-capped attention: scores written out in full (layers.attend)
    "gemma2-9b": Preset(
        _gemma("Gemma2ForCausalLM", 256000, 3584, 14336, 42, 16, 8, 256, window=4096, pattern=2,
               attn_softcap=50.0, final_softcap=30.0),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # text part of gemma-3-12b: 5 sliding (1024) layers per full one, local and global RoPE
    "gemma3-12b": Preset(
        _gemma("Gemma3ForCausalLM", 262208, 3840, 15360, 48, 16, 8, 256, window=1024, pattern=6,
               qk_norm=True, rope_theta=1e6, rope_local_theta=1e4,
               rope_scaling=(("factor", 8.0), ("rope_type", "linear")),
               max_position_embeddings=131072),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # fused qkv / gate_up, RoPE on 96 of 128 head dimensions, longrope, tied 200k vocabulary
    "phi4-mini": Preset(
        _family("Phi3ForCausalLM", 200064, 3072, 8192, 32, 24, 8, 128,
                rms_norm_eps=1e-5, partial_rotary_factor=0.75, rope_scaling=_LONGROPE_48,
                max_position_embeddings=131072, sliding_window=262144, tie_word_embeddings=True),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # mixture of experts at the released shapes: 128 experts, top 8 (3.3B of 30.5B active)
    "qwen3-30b-a3b": Preset(
        _family("Qwen3MoeForCausalLM", 151936, 2048, 6144, 48, 32, 4, 128,
                rope_theta=1e6, max_position_embeddings=40960, qk_norm=True, num_experts=128,
                experts_per_token=8, moe_intermediate_size=768, norm_topk_prob=True),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # sinks, sliding (128) and full layers, YaRN; 32 experts, top 4 (3.6B of 20.9B active),
    # the experts in bf16 (the released MXFP4 ones dequantized)
    "gpt-oss-20b": Preset(
        _family("GptOssForCausalLM", 201088, 2880, 2880, 24, 64, 8, 64,
                rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
                rope_scaling=_YARN_32, attention_bias=True, o_bias=True, sliding_window=128,
                layer_types=("sliding_attention", "full_attention") * 12, num_experts=32,
                experts_per_token=4, moe_intermediate_size=2880),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # language model of Qwen3.6-27B: 48 Gated DeltaNet layers (16 key / 48 value heads of 128),
    # 16 gated full-attention layers (24 / 4 heads of 256, RoPE on 64 dims), untied 248k vocab
    "qwen3.6-27b": Preset(
        _family("Qwen3_5ForCausalLM", 248320, 5120, 17408, 64, 24, 4, 256,
                rope_theta=1e7, max_position_embeddings=262144, qk_norm=True, norm_offset=1.0,
                attn_output_gate=True, partial_rotary_factor=0.25, layer_types=_hybrid(64, 4),
                linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel=4),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # language model of Qwen3.6-35B-A3B: the hybrid layout of qwen3.6-27b (30 Gated DeltaNet, 10
    # gated full-attention layers) at hidden 2048, each block's MLP 256 experts of width 512, top
    # 8, plus a shared expert of width 512 (34.7B, 2.4B of them active in the blocks)
    "qwen3.6-35b-a3b": Preset(
        _family("Qwen3_5MoeForCausalLM", 248320, 2048, 512, 40, 16, 2, 256,
                rope_theta=1e7, max_position_embeddings=262144, qk_norm=True, norm_offset=1.0,
                attn_output_gate=True, partial_rotary_factor=0.25, layer_types=_hybrid(40, 4),
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel=4, num_experts=256,
                experts_per_token=8, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, fused_experts=True),
        gpu=_GPU_SHAPE, cpu=None,
    ),
    # language model of gemma-4-31B: 50 sliding (1024; 16 KV heads of 256) and 10 full layers
    # (4 KV heads of 512, values = keys, proportional RoPE on a quarter), final soft cap 30
    "gemma4-31b": Preset(
        _family("Gemma4ForCausalLM", 262144, 5376, 21504, 60, 32, 16, 256,
                rope_theta=1e6, max_position_embeddings=262144, qk_norm=True,
                embed_scale=5376**0.5, attn_scale=1.0, final_softcap=30.0,
                tie_word_embeddings=True, sliding_window=1024,
                layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                  for i in range(60)),
                rope_local_theta=1e4, global_head_dim=512, num_global_kv_heads=4,
                attention_k_eq_v=True,
                rope_scaling=(("factor", 1.0), ("partial_rotary_factor", 0.25),
                              ("rope_type", "proportional"))),
        gpu=_GPU_SHAPE, cpu=None,
    ),
}  # fmt: skip


def presets_help() -> str:
    """One line per preset: its shape and the step it times (for --help)."""
    lines = ["presets (random weights in memory, nothing downloaded):"]
    for name, p in PRESETS.items():
        a, g = p.args, p.gpu
        where = "also on CPU" if p.cpu else "GPU only"
        lines.append(
            f"  {name:11} {a.architecture}: {a.num_layers} blocks, hidden {a.hidden_size}, "
            f"vocab {a.vocab_size}; GPU step {g.micro_batches}x{g.micro_batch_size}x{g.seq_len} "
            f"tokens; {where}"
        )
    return "\n".join(lines)
