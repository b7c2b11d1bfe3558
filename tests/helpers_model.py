"""Tiny Hugging Face checkpoints made in a temp dir (random init, `save_pretrained`).

Each variant exercises one architecture feature the engine must reproduce exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from appliance.config import TrainConfig, build_config
from appliance.models.lora import LoraSpec, LoraWeights
from tests.helpers_tokenizer import make_tokenizer

VOCAB = 64  # ≥ the test tokenizer's vocabulary
MULTIMODAL = (
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Gemma 3: q/k norms, sliding/full layers with their own RoPE bases, linear scaling on the full ones
GEMMA3_LOCAL_ROPE = dict(
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    query_pre_attn_scalar=24,
)

QWEN3_5_HYBRID = dict(
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)

# Qwen3.5-MoE: the hybrid blocks above, each with top-2 of 6 experts (renormalised) and a
# shared expert of its own width; the load-balancing loss on
QWEN3_5_MOE = dict(
    QWEN3_5_HYBRID,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)

# Gemma 4: sliding (head 16, 2 KV heads) and full layers (head 32, one KV head, values = keys),
# per-layer embeddings, the last two blocks reusing the K/V of blocks 1 and 2 with a double-wide
# MLP, a final soft cap
GEMMA4_PLE_KV_SHARED = dict(
    num_hidden_layers=5,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "full_attention"],
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    use_double_wide_mlp=True,
    final_logit_softcapping=5.0,
)  # fmt: skip

# Gemma 4's MoE block (26B-A4B): sliding (head 16) and full layers (head 32, values = keys),
# each block's dense MLP beside top-2 of 6 experts; no per-layer embeddings, no KV sharing, as
# released
GEMMA4_MOE = dict(
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    enable_moe_block=True,
    num_experts=6,
    top_k_experts=2,
    moe_intermediate_size=24,
    final_logit_softcapping=5.0,
)

VARIANTS: dict[str, tuple[str, dict]] = {
    "llama-mha": ("LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama-gqa-rope3-tied": (
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-attn-bias": ("LlamaForCausalLM", dict(attention_bias=True)),  # q, k, v and o biases
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, rope_theta=1000000.0)),
    # q/k head norms, head_dim 32 ≠ hidden / heads, tied embeddings
    "qwen3-qknorm-tied": (
        "Qwen3ForCausalLM",
        dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
    ),
    # sliding window 8 < T on alternate layers, scalar ≠ head_dim; weights large enough (init
    # 0.3) that both soft caps bite (without them the loss moves by 1% and 150%)
    "gemma2-softcap-window": (
        "Gemma2ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=32,
            initializer_range=0.3,
        ),
    ),
    "gemma3-local-rope": ("Gemma3ForCausalLM", GEMMA3_LOCAL_ROPE),
    # fused qkv/gate_up, RoPE on half of each head, longrope (T > 16 takes the long factors),
    # sliding window 20 < T
    "phi3-partial-longrope": (
        "Phi3ForCausalLM",
        dict(
            num_key_value_heads=2,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=16,
            sliding_window=20,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
        ),
    ),
    # the language model of an image-text model (models/multimodal.py): Gemma 3's as above, its
    # LM head tied to the embeddings (as released)
    "gemma3-vlm": ("Gemma3ForConditionalGeneration", GEMMA3_LOCAL_ROPE),
    # Mistral Small 3.1's shape: head_dim ≠ hidden / heads, an LM head of its own
    "mistral3-vlm": (
        "Mistral3ForConditionalGeneration",
        dict(num_key_value_heads=2, head_dim=32, sliding_window=None, rope_theta=1e6),
    ),
    # mixture of experts (models/moe.py): top-8 of 10 experts renormalised, q/k head norms, the
    # load-balancing loss on
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, num_experts=10, num_experts_per_tok=8,
             moe_intermediate_size=24, norm_topk_prob=True, output_router_logits=True,
             router_aux_loss_coef=0.05, rope_theta=1e6),
    ),
    # top-2 of 4, always renormalised, weights in fp32; a sliding window 20 < T; the loss on
    "mixtral": (
        "MixtralForCausalLM",
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
             intermediate_size=40, sliding_window=20, output_router_logits=True,
             router_aux_loss_coef=0.02),
    ),
    # top-2 of 6, not renormalised; q/k norms over whole projections, q/k/v clipped
    "olmoe": (
        "OlmoeForCausalLM",
        dict(num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, intermediate_size=32,
             clip_qkv=0.5),
    ),
    # sinks, sliding (8 < T) and full layers, biases everywhere, YaRN (T > 16: interpolated
    # frequencies), top-2 of 6 by the top logits then softmax, clamped SwiGLU; the loss on
    "gpt-oss": (
        "GptOssForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
             intermediate_size=24, sliding_window=8, output_router_logits=True,
             router_aux_loss_coef=0.02,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                              "original_max_position_embeddings": 16}),
    ),
    # Qwen3.5 dense: Gated DeltaNet, gated full attention, Gated DeltaNet (2 key heads serving 4
    # value heads), RoPE on a quarter of each head
    "qwen3_5-hybrid": ("Qwen3_5ForCausalLM", QWEN3_5_HYBRID),
    # the language model of Qwen3.5's image-text checkpoint (its vision tower beside it)
    "qwen3_5-vlm": ("Qwen3_5ForConditionalGeneration", QWEN3_5_HYBRID),
    "gemma4-ple-kv-shared": ("Gemma4ForCausalLM", GEMMA4_PLE_KV_SHARED),
    # the language model of Gemma 4's image-text checkpoint (vision tower beside it)
    "gemma4-vlm": ("Gemma4ForConditionalGeneration", GEMMA4_PLE_KV_SHARED),
    "qwen3_5-moe": ("Qwen3_5MoeForCausalLM", QWEN3_5_MOE),
    # Qwen2-MoE: q/k/v biases, top-2 of 6 experts not renormalised, a shared expert; the loss on
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        dict(num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
             shared_expert_intermediate_size=40, output_router_logits=True,
             router_aux_loss_coef=0.02),
    ),
    "gemma4-moe": ("Gemma4ForCausalLM", GEMMA4_MOE),
    # the language model of Qwen3.5-MoE's image-text checkpoint (its vision tower beside it)
    "qwen3_5-moe-vlm": ("Qwen3_5MoeForConditionalGeneration", QWEN3_5_MOE),
}  # fmt: skip
MOE_VARIANTS = ("qwen3-moe", "mixtral", "olmoe", "gpt-oss")


def _multimodal(config_class, vision: dict, **outer):
    """An image-text config: the text variant's keys in text_config, a tiny vision tower."""

    def make(**text):
        return config_class(text_config=text, vision_config=vision, **outer)

    return make


_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               image_size=28, patch_size=14)  # fmt: skip
# a one-layer vision tower for the Qwen3.5 image-text checkpoints (dense and MoE)
QWEN3_5_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14
)

_CONFIGS = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "MistralForCausalLM": transformers.MistralConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "Gemma2ForCausalLM": transformers.Gemma2Config,
    "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
    "Phi3ForCausalLM": transformers.Phi3Config,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    "MixtralForCausalLM": transformers.MixtralConfig,
    "OlmoeForCausalLM": transformers.OlmoeConfig,
    "GptOssForCausalLM": transformers.GptOssConfig,
    "Gemma3ForConditionalGeneration": _multimodal(
        transformers.Gemma3Config, _VISION, mm_tokens_per_image=4
    ),
    "Mistral3ForConditionalGeneration": _multimodal(
        transformers.Mistral3Config, {**_VISION, "head_dim": 16}, tie_word_embeddings=False
    ),
    "Qwen3_5ForCausalLM": transformers.Qwen3_5TextConfig,
    "Gemma4ForCausalLM": transformers.Gemma4TextConfig,
    "Gemma4ForConditionalGeneration": _multimodal(
        transformers.Gemma4Config,
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        audio_config=None,
    ),
    "Qwen3_5MoeForCausalLM": transformers.Qwen3_5MoeTextConfig,
    "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
    "Qwen3_5MoeForConditionalGeneration": _multimodal(
        transformers.Qwen3_5MoeConfig,
        QWEN3_5_VISION,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "Qwen3_5ForConditionalGeneration": _multimodal(
        transformers.Qwen3_5Config,
        QWEN3_5_VISION,
        tie_word_embeddings=False,
    ),
}


def make_model(
    directory: str | Path,
    variant: str = "llama-mha",
    seed: int = 0,
    shards: bool = False,
    with_tokenizer: bool = True,
    **overrides,
) -> Path:
    """Save a random tiny model of `variant` (+ the test tokenizer) into `directory`.

    Gated DeltaNet's A_log is drawn as log U(0.05, 1), not transformers' log U(0.01, 16): with
    A up to 16 the state decays by e^-20 per token and forgets everything at once, and the
    decay's LoRA gradients become tiny sums of large terms that two correct fp32 computations
    (ours, transformers') round 1e-4 apart. Gemma 4 does not scale its scores by 1/sqrt(head
    size) (its q/k norms' weights do); at transformers' init of 1 they are so peaked that either
    fp32 computation is 1e-5 from fp64: the q/k norm weights are halved here."""
    arch, extra = VARIANTS[variant]
    cfg = _CONFIGS[arch](**{**BASE, **extra, **overrides})
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float()
    with torch.no_grad():  # make biases visible to the parity check (HF initialises them to 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # decisive routing
                p.mul_(10.0)
            if name.endswith("router.proj.weight"):  # Gemma 4's: its input is scaled by C^-1/2
                p.mul_(50.0)
            if name.endswith(("router.scale", "router.per_expert_scale")):  # not all ones
                p.add_(torch.randn_like(p) * 0.1)
            if arch.startswith("Gemma4") and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)  # Gemma 4's unscaled scores: as 1/sqrt(head size) would (below)
            if name.endswith("A_log"):  # Gated DeltaNet: decays that keep some state (below)
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size="100KB" if shards else "5GB")
    if with_tokenizer:
        make_tokenizer(directory)
    return directory


def write_config(directory: str | Path, arch: str = "LlamaForCausalLM", **changes) -> Path:
    """Only the config.json of a tiny `arch` model (as transformers writes it), with `changes`
    applied to the JSON (a value of None deletes the key)."""
    import json

    cfg = _CONFIGS[arch](**BASE)
    cfg.architectures = [arch]
    directory = Path(directory)
    cfg.save_pretrained(directory)
    path = directory / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return directory


def load_hf(directory: str | Path) -> transformers.PreTrainedModel:
    """The reference model, in fp32 with eager attention: the definition itself. (transformers
    5.17, as on the GPU image, picks SDPA for Gemma 2 and drops its attention soft-capping;
    later releases refuse SDPA for it.) An image-text model is loaded whole, vision tower too."""
    import json

    arch = json.loads((Path(directory) / "config.json").read_text())["architectures"][0]
    auto = getattr(transformers, arch) if arch in MULTIMODAL else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# one variant per family added with the model families (appliance/models/), every feature on
FAMILY_VARIANTS = (
    "qwen3-qknorm-tied",
    "gemma2-softcap-window",
    "gemma3-local-rope",
    "phi3-partial-longrope",
    "gemma3-vlm",
    "mistral3-vlm",
)
SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=ALL_TARGETS)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖, in fp32 on the CPU."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def lora_with_random_b(
    args, spec: LoraSpec = SPEC, device: str | torch.device = "cpu", seed: int = 1
) -> LoraWeights:
    """The same LoRA on any device (made on the CPU), with non-zero B so every gradient is live."""
    lora = LoraWeights(args, spec, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for block in lora.blocks:
            for _, B in block.values():
                B.copy_(torch.randn(B.shape, generator=g) * 0.1)
    return lora


def batch(n_rows: int, T: int, seed: int = 0, vocab: int = VOCAB, prompt: int = 3):
    """(input_ids (n_rows, T), labels (n_rows, T)); the first `prompt` positions carry no loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n_rows, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :prompt] = -100  # some positions carry no loss, as prompts and padding do
    return ids[:, :-1].contiguous(), labels


def tiny_train_config(model_dir, data, output, **overrides) -> TrainConfig:
    """`appliance train` settings for a tiny model: a few seconds a run on a CPU, fast learning
    (lr 1e-2), JSON progress; `overrides` are any TrainConfig fields."""
    base = dict(
        model=str(model_dir),
        data=str(data),
        output=str(output),
        seq_len=16,
        micro_batch_size=2,
        micro_batches_per_step=2,
        tokenize_workers=2,
        lr=1e-2,
        warmup_steps=1,
        lora_rank=4,
        lora_alpha=8.0,
        log_format="json",
    )
    return build_config({}, {**base, **overrides})


def config_only_7b(tmp: Path, weight_bytes: int) -> Path:
    """A Llama-2-7B-shaped config.json (no weights) with enough blocks that its fp32 weight store
    takes about `weight_bytes`: what doctor and train's RAM checks read, nothing to load."""
    import json
    import math

    from appliance.models.presets import PRESETS
    from appliance.plan.estimate import block_bytes

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": math.ceil(weight_bytes / block_bytes(PRESETS["7b"].args, 4)),
        "num_attention_heads": 32,
        "max_position_embeddings": 4096,
        "eos_token_id": 2,
    }
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp
