"""Multimodal checkpoints whose language model the appliance trains (text in, text out).

Gemma 3 from 4B up and Mistral Small 3.1 are released only as image-text models
(`Gemma3ForConditionalGeneration`, `Mistral3ForConditionalGeneration`): a vision tower and a
projector beside an ordinary language model. The appliance reads, streams and adapts the language
model alone (its blocks are those of the text family: `ModelArgs.architecture` is
`Gemma3ForCausalLM` or `MistralForCausalLM`, `ModelArgs.language_model_of` the multimodal one) and
leaves the vision tower as it is on disk: not loaded, not trained, copied unchanged by `appliance
export`. Three things differ from a text checkpoint, and all three are here:

- config.json nests the language model's settings in `text_config`, where transformers writes only
  the keys that differ from its text config class's defaults (so the released files are sparse):
  `language_config` fills in those defaults (TEXT_DEFAULTS, the classes' own values);
- the tensors are named under the language model: `language_model.model.layers.0. …` (as the
  released files and transformers' `save_pretrained` write them) or `model.language_model.layers.
  0. …` (the modules' own names in transformers ≥ 4.52): `language_names` maps them onto the
  text names the rest of the appliance uses (`model.layers.0. …`, `lm_head.weight`);
- the LoRA adapter is keyed by the multimodal model's module names (`base_model.model.model.
  language_model.layers.0. …`), and its `target_modules` is a pattern that matches the language
  model's projections only (the vision tower has q_proj, k_proj, … too): PEFT then adapts the same
  modules the appliance trained, and the adapter loads on the multimodal model with no missing key.

Images are not supported: a record is text (or a conversation of text), as for any other model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

# multimodal architecture → (the text architecture of its language model, that text config
# class's defaults: transformers' Gemma3TextConfig and MistralConfig, checked against them by
# tests/models/test_model_families.py). Only constants: values transformers derives from other keys
# (Mistral's head_dim, Gemma 3's layer_types) are derived by hf_checkpoint as transformers does.
TEXT_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForCausalLM",
        dict(
            vocab_size=262208,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            attention_bias=False,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            sliding_window_pattern=6,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    "Mistral3ForConditionalGeneration": (
        "MistralForCausalLM",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            hidden_act="silu",
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_theta=1e4,
            sliding_window=4096,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "Qwen3_5ForConditionalGeneration": (
        "Qwen3_5ForCausalLM",
        dict(
            vocab_size=248320,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1e4,
            attention_bias=False,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            tie_word_embeddings=False,
        ),
    ),
    "Qwen3_5MoeForConditionalGeneration": (
        "Qwen3_5MoeForCausalLM",
        dict(
            vocab_size=248320,
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1e4,
            attention_bias=False,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            router_aux_loss_coef=0.001,
            tie_word_embeddings=False,
        ),
    ),
    "Gemma4ForConditionalGeneration": (
        "Gemma4ForCausalLM",
        dict(
            vocab_size=262144,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=30,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            attention_bias=False,
            sliding_window=512,
            final_logit_softcapping=None,
            vocab_size_per_layer_input=262144,
            hidden_size_per_layer_input=256,
            attention_k_eq_v=False,
            num_kv_shared_layers=0,
            use_double_wide_mlp=False,
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
}
ARCHITECTURES = tuple(TEXT_DEFAULTS)

# how the language model's tensors are stored → the text names (prefix for prefix)
_STORED_PREFIXES = (
    ("language_model.model.", "model."),  # released files; transformers' save_pretrained
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # the module names of transformers ≥ 4.52
)
# where the language model's blocks are among the multimodal model's modules (PEFT's keys)
LAYERS = "model.language_model.layers"


def language_config(cfg: dict) -> tuple[str, dict]:
    """(the text architecture, the language model's config as a text model's config.json would
    hold it) from a multimodal config.json: `text_config` over its class's defaults; the token
    ids and `tie_word_embeddings` of the outer config, where it gives them, win."""
    arch = cfg["architectures"][0]
    text_arch, defaults = TEXT_DEFAULTS[arch]
    text = {**defaults, **(cfg.get("text_config") or {})}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return text_arch, text


def language_names(stored: Iterable[str]) -> dict[str, str]:
    """text name → stored name of each language-model tensor among a multimodal checkpoint's
    `stored` names (the vision tower's and the projector's are not among them); empty for a text
    checkpoint, whose names are the text names."""
    out = {}
    for name in stored:
        for prefix, text_prefix in _STORED_PREFIXES:
            if name.startswith(prefix):
                out[text_prefix + name[len(prefix) :]] = name
                break
    return out


def stored_name_like(name: str, names: dict[str, str]) -> str:
    """The name the text-named tensor `name` has, or would have, in files whose language-model
    tensors are named as `names` says (`language_names`' result): to name a missing tensor as the
    files would hold it."""
    head = name.split(".", 1)[0] + "."  # model. or lm_head.
    for text, stored in names.items():
        if text.startswith(head):
            rest = text[len(head) :]
            return stored[: len(stored) - len(rest)] + name[len(head) :]
    return name


def target_pattern(module_names: Iterable[str]) -> str:
    """PEFT's `target_modules` as a pattern: the named projections of the language model only."""
    names = "|".join(re.escape(n) for n in module_names)
    return rf".*language_model.*\.({names})"


def names_of_pattern(pattern: str) -> list[str] | None:
    """The projection names of a `target_pattern` (None: some other pattern)."""
    m = re.fullmatch(r"\.\*language_model\.\*\\\.\(((?:[A-Za-z0-9_|]|\\\.)+)\)", pattern)
    return m.group(1).replace("\\.", ".").split("|") if m else None
