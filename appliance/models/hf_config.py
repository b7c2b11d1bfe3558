"""config.json's fields, family by family, as the ModelArgs fields they give (hf_checkpoint's
read_model_args checks the architecture and the files; this reads the numbers). Each reader
refuses, naming the field, what the engine does not implement (a RoPE type, an activation, a
partial rotary factor), and takes transformers' defaults for a field left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance import models
from appliance.errors import ModelError

_LAYER_TYPES = ("sliding_attention", "full_attention")


def model_fields(arch: str, cfg: dict, where: Path) -> dict[str, Any]:
    """ModelArgs' fields from config.json `cfg` of architecture `arch` (`where` names the file
    in errors); KeyError for a required field left out (read_model_args names it)."""
    if arch == "Qwen3_5MoeForCausalLM" and "intermediate_size" not in cfg:
        # no dense MLP: the block's dense width is its shared expert's
        cfg = {**cfg, "intermediate_size": cfg.get("shared_expert_intermediate_size", 512)}
    fields = _common_fields(arch, cfg, where)
    family = models.FAMILIES[arch]
    if family is models.qwen3:
        fields.update(_qwen3_fields(cfg, where))
    elif family is models.gemma:
        fields.update(_gemma_fields(arch, cfg, where, fields["num_layers"]))
    elif family is models.phi3:
        fields.update(_phi3_fields(cfg, where, fields))
    elif family in (models.qwen3_moe, models.olmoe, models.qwen2_moe):
        fields.update(_moe_fields(arch, cfg, where, fields))
    elif family is models.gpt_oss:
        fields.update(_gpt_oss_fields(cfg, where, fields["num_layers"]))
    elif family is models.qwen3_5:
        fields.update(_qwen3_5_fields(cfg, where, fields["num_layers"]))
    elif family is models.qwen3_5_moe:
        fields.update(_qwen3_5_fields(cfg, where, fields["num_layers"]))
        fields.update(_qwen3_5_moe_fields(cfg, where))
    elif family is models.gemma4:
        fields.update(_gemma4_fields(cfg, where, fields))
    else:
        fields.update(_llama_fields(arch, cfg, where))
    return fields


#: the shapes config.json gives: each a whole number ≥ 1 where present
_SHAPES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def check_shapes(cfg: dict, where: Path) -> None:
    """ModelError, one line naming the field, for a shape in config.json that no model has: zero,
    negative or not a whole number (`hidden_size: 1e9`), or heads that do not divide (query heads
    by key/value heads; hidden_size by the heads, with no head_dim). Checked before anything is
    sized from them (the RAM estimate blamed the box's RAM for them)."""
    for key in _SHAPES:
        value = cfg.get(key)
        if value is None:  # left out: a required one is named by read_model_args
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelError(
                f"{where}: {key} is {value!r}, not a whole number ≥ 1; fix config.json (or "
                "download the model again)"
            )
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ModelError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv}; fix config.json (or download the model again)"
        )
    hidden = cfg.get("hidden_size")
    if heads and hidden and not cfg.get("head_dim") and hidden % heads:
        raise ModelError(
            f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
            "(and no head_dim is given); fix config.json (or download the model again)"
        )


def _common_fields(arch: str, cfg: dict, where: Path) -> dict[str, Any]:
    """What every family reads the same way (the family readers below override some)."""
    check_shapes(cfg, where)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return dict(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=cfg.get("pad_token_id"),
    )


def _rope_dict(cfg: dict) -> tuple[str, dict]:
    """(the field's name, its contents): transformers ≥5 nests rope settings in
    `rope_parameters`; older files use rope_theta / rope_scaling."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    return field, dict(cfg.get(field) or {})


def _rope(
    rope: dict, cfg: dict, where: Path, field: str, kinds: tuple[str, ...], theta: float = 1e4
) -> tuple[float, tuple | None]:
    """(rope_theta, ModelArgs.rope_scaling) from one rope settings dict, of a type in `kinds`."""
    rope = dict(rope)
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", theta)))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind == "su":  # Phi-3's early name for longrope
        kind = "longrope"
    if kind == "default":
        return rope_theta, None
    if kind not in kinds:
        raise ModelError(
            f"{where}: {field} type {kind!r} is not supported (only "
            f"{' or '.join(kinds + ('none',))})"
        )
    keys = {
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "linear": ("factor",),
        "longrope": ("short_factor", "long_factor"),
        "yarn": ("factor",),
    }[kind]
    if kind != "linear" and "original_max_position_embeddings" in cfg:
        rope.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    if kind != "linear":
        keys += ("original_max_position_embeddings",)
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ModelError(f"{where}: {field} of type {kind} lacks {', '.join(missing)}")
    lists = ("short_factor", "long_factor")
    items: dict[str, Any] = {k: float(rope[k]) for k in keys if k not in lists}
    if kind == "llama3":  # (no rope_type item: llama3 is the default reading of rope_scaling)
        return rope_theta, tuple(sorted(items.items()))
    items["rope_type"] = kind
    if kind == "yarn":  # optional (rope._yarn_inv_freq, rope._yarn_attention_factor)
        for k in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if rope.get(k) is not None:
                items[k] = float(rope[k])
        items["truncate"] = bool(rope.get("truncate", True))
    if kind == "longrope":
        items["short_factor"] = tuple(float(x) for x in rope["short_factor"])
        items["long_factor"] = tuple(float(x) for x in rope["long_factor"])
        for k in ("factor", "attention_factor"):  # optional (rope.rope_attention_factor)
            if rope.get(k) is not None:
                items[k] = float(rope[k])
    return rope_theta, tuple(sorted(items.items()))


def _activation(cfg: dict, where: Path, key: str, allowed: str) -> str:
    act = cfg.get(key, allowed)
    if act != allowed:
        raise ModelError(f"{where}: {key}={act!r} is not supported (only {allowed!r})")
    return act


def _no_partial_rotary(cfg: dict, rope: dict, where: Path) -> None:
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ModelError(
            f"{where}: partial_rotary_factor={partial} is not supported (only 1.0: RoPE on every "
            "dimension of a head)"
        )


def _llama_fields(arch: str, cfg: dict, where: Path) -> dict[str, Any]:
    """Llama, Mistral, Qwen2."""
    _activation(cfg, where, "hidden_act", "silu")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ("llama3",))
    _no_partial_rotary(cfg, rope, where)
    out: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling)
    out["mlp_bias"] = bool(cfg.get("mlp_bias", False))
    sliding = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        out["attention_bias"], out["o_bias"] = True, False  # Qwen2: bias on q, k, v only
        if cfg.get("use_sliding_window", False):
            raise ModelError(f"{where}: use_sliding_window=true is not supported")
        sliding = None
    out["sliding_window"] = int(sliding) if sliding else None
    return out


def _qwen3_fields(cfg: dict, where: Path) -> dict[str, Any]:
    _activation(cfg, where, "hidden_act", "silu")
    if cfg.get("use_sliding_window", False):
        raise ModelError(f"{where}: use_sliding_window=true is not supported")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ())
    _no_partial_rotary(cfg, rope, where)
    return dict(rope_theta=theta, rope_scaling=scaling, qk_norm=True)


def _layer_types(cfg: dict, where: Path, num_layers: int, pattern: int) -> tuple[str, ...]:
    """`layer_types` as written, else the alternation: every `pattern`-th block full, the
    others sliding (Gemma 2: 2, Gemma 3: sliding_window_pattern, 6 by default)."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    bad = [t for t in types if t not in _LAYER_TYPES]
    if len(types) != num_layers or bad:
        raise ModelError(
            f"{where}: layer_types must list {num_layers} of {', '.join(_LAYER_TYPES)} "
            f"(found {len(types)}{', e.g. ' + repr(bad[0]) if bad else ''})"
        )
    return tuple(types)


def _gemma_fields(arch: str, cfg: dict, where: Path, num_layers: int) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text)."""
    key = "hidden_activation" if "hidden_activation" in cfg else "hidden_act"  # the first wins
    _activation(cfg, where, key, "gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention"):
        raise ModelError(f"{where}: use_bidirectional_attention=true is not supported")
    hidden = int(cfg["hidden_size"])
    gemma3 = arch == "Gemma3ForCausalLM"
    out: dict[str, Any] = dict(
        norm_offset=1.0,
        embed_scale=hidden**0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        # transformers' Gemma 3 attention does not apply attn_logit_softcapping: neither do we
        attn_softcap=None if gemma3 else _float_or_none(cfg.get("attn_logit_softcapping")),
        final_softcap=_float_or_none(cfg.get("final_logit_softcapping")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        qk_norm=gemma3,
    )
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    out["layer_types"] = _layer_types(cfg, where, num_layers, pattern if gemma3 else 2)
    field, rope = _rope_dict(cfg)
    if not gemma3:
        out["rope_theta"], out["rope_scaling"] = _rope(rope, cfg, where, field, ())
        _no_partial_rotary(cfg, rope, where)
        return out
    if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (transformers ≥5)
        full, local = (
            dict(rope.get("full_attention") or {}),
            dict(rope.get("sliding_attention") or {}),
        )
    else:  # rope_theta + rope_scaling for the full layers, rope_local_base_freq for the others
        full = {**rope, "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    out["rope_theta"], out["rope_scaling"] = _rope(
        full, {}, where, f"{field} (full_attention)", ("linear",), theta=1e6
    )
    out["rope_local_theta"], _ = _rope(
        local, {}, where, f"{field} (sliding_attention)", (), theta=1e4
    )
    return out


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _phi3_fields(cfg: dict, where: Path, common: dict[str, Any]) -> dict[str, Any]:
    _activation(cfg, where, "hidden_act", "silu")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ("longrope",))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rot = int(common["head_dim"] * partial)
    if not 0 < partial <= 1 or rot < 2 or rot % 2:
        raise ModelError(
            f"{where}: partial_rotary_factor={partial} gives {rot} rotated dimensions per head; "
            "need an even number ≥ 2"
        )
    for key, value in scaling or ():
        if key in ("short_factor", "long_factor") and len(value) != rot // 2:
            raise ModelError(
                f"{where}: {field}.{key} has {len(value)} values; {rot // 2} expected "
                f"(half the {rot} rotated dimensions)"
            )
    sliding = cfg.get("sliding_window")
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        attention_bias=False,  # Phi-3's projections have no bias
        o_bias=False,
        sliding_window=int(sliding) if sliding else None,
    )


# config.json's expert fields by architecture: (number of experts, expert width, its default
# top-k, the load-balancing loss's default weight); transformers' defaults for what is left out
_MOE = {
    "Qwen3MoeForCausalLM": ("num_experts", "moe_intermediate_size", 8, 0.001),
    "MixtralForCausalLM": ("num_local_experts", "intermediate_size", 2, 0.001),
    "OlmoeForCausalLM": ("num_experts", "intermediate_size", 8, 0.01),
    "Qwen2MoeForCausalLM": ("num_experts", "moe_intermediate_size", 4, 0.001),
}


def _moe_fields(arch: str, cfg: dict, where: Path, common: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE (models/qwen3_moe.py, olmoe.py, qwen2_moe.py): every
    block sparse, routed by softmax then top-k. What they could also say and the blocks do not
    implement (dense blocks among the sparse ones, router noise, a sliding window on Qwen3-MoE
    and Qwen2-MoE) is refused by name."""
    _activation(cfg, where, "hidden_act", "silu")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ())
    _no_partial_rotary(cfg, rope, where)
    n_key, width_key, top_k, coef = _MOE[arch]
    if n_key not in cfg and "num_local_experts" in cfg:  # transformers ≥5 writes this name
        n_key = "num_local_experts"
    experts = int(cfg.get(n_key, 0) or 0)
    k = int(cfg.get("num_experts_per_tok", top_k))
    if experts < 1 or not 1 <= k <= experts:
        raise ModelError(
            f"{where}: {n_key}={experts} with num_experts_per_tok={k}: need 1 ≤ "
            f"num_experts_per_tok ≤ {n_key}"
        )
    if cfg.get("mlp_only_layers"):
        raise ModelError(f"{where}: mlp_only_layers (dense blocks among the MoE ones) is not "
                         "supported")  # fmt: skip
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ModelError(
            f"{where}: decoder_sparse_step={cfg['decoder_sparse_step']} (dense blocks among the "
            "MoE ones) is not supported (only 1)"
        )
    if float(cfg.get("router_jitter_noise") or 0.0):
        raise ModelError(f"{where}: router_jitter_noise={cfg['router_jitter_noise']} is not "
                         "supported (only 0)")  # fmt: skip
    out: dict[str, Any] = dict(
        rope_theta=theta,
        rope_scaling=scaling,
        num_experts=experts,
        experts_per_token=k,
        moe_intermediate_size=int(cfg.get(width_key) or common["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_aux_coef=float(cfg.get("router_aux_loss_coef", coef))
        if cfg.get("output_router_logits")
        else 0.0,
    )
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        if cfg.get("use_sliding_window", False):
            raise ModelError(f"{where}: use_sliding_window=true is not supported")
    if arch == "Qwen3MoeForCausalLM":
        out["qk_norm"] = True
    elif arch == "Qwen2MoeForCausalLM":  # biases on q, k, v (not o); a shared expert
        out["attention_bias"] = bool(cfg.get("qkv_bias", True))
        out["o_bias"] = False
        out["shared_expert_intermediate_size"] = int(
            cfg.get("shared_expert_intermediate_size", 5632)
        )
    elif arch == "MixtralForCausalLM":
        sliding = cfg.get("sliding_window")
        out["sliding_window"] = int(sliding) if sliding else None
    else:  # OLMoE: the norms are over whole projections (olmoe.py), not per head
        if (
            "head_dim" in cfg
            and int(cfg["head_dim"]) * common["num_heads"] != common["hidden_size"]
        ):
            raise ModelError(f"{where}: head_dim must be hidden_size / num_attention_heads")
        clip = cfg.get("clip_qkv")
        out["clip_qkv"] = float(clip) if clip is not None else None
    return out


def _gpt_oss_fields(cfg: dict, where: Path, num_layers: int) -> dict[str, Any]:
    """gpt-oss (models/gpt_oss.py): YaRN RoPE, alternating sliding/full layers, biases on every
    projection, top-k-then-softmax routing. Its released checkpoints' MXFP4 experts are
    dequantized on load (hf_checkpoint, models/mxfp4.py); another quantization is refused."""
    qc = cfg.get("quantization_config") or {}
    if qc and qc.get("quant_method") != "mxfp4":
        method = qc.get("quant_method", "?")
        raise ModelError(
            f"{where}: quantization_config (quant_method {method!r}) is not supported; "
            "supported: the released MXFP4 experts (quant_method 'mxfp4'), or none"
        )
    for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        if float(cfg.get(key, default)) != default:
            raise ModelError(f"{where}: {key}={cfg[key]} is not supported (only {default})")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ("yarn",), theta=150000.0)
    _no_partial_rotary(cfg, rope, where)
    experts, k = int(cfg.get("num_local_experts", 128)), int(cfg.get("num_experts_per_tok", 4))
    if not 1 <= k <= experts:
        raise ModelError(
            f"{where}: num_local_experts={experts} with num_experts_per_tok={k}: need 1 ≤ "
            "num_experts_per_tok ≤ num_local_experts"
        )
    bias = bool(cfg.get("attention_bias", True))
    sliding = cfg.get("sliding_window", 128)
    types = _layer_types(cfg, where, num_layers, 2)  # left out: sliding, full, sliding, ...
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bias,
        o_bias=bias,
        sliding_window=int(sliding) if sliding else None,
        layer_types=types,
        num_experts=experts,
        experts_per_token=k,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        router_aux_coef=float(cfg.get("router_aux_loss_coef", 0.001))
        if cfg.get("output_router_logits")
        else 0.0,
    )


_HYBRID_TYPES = ("linear_attention", "full_attention")


def _qwen3_5_fields(cfg: dict, where: Path, num_layers: int) -> dict[str, Any]:
    """Qwen3.5 / Qwen3.6 dense (text): Gated DeltaNet and gated full-attention layers
    (models/qwen3_5.py). RoPE on a quarter of each head by default; the multimodal RoPE's
    sections are read as plain RoPE (text positions are equal in all three)."""
    _activation(cfg, where, "hidden_act", "silu")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ())
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    head_dim = int(cfg.get("head_dim", 256))
    rot = int(head_dim * partial)
    if not 0 < partial <= 1 or rot < 2 or rot % 2:
        raise ModelError(
            f"{where}: partial_rotary_factor={partial} gives {rot} rotated dimensions per head; "
            "need an even number ≥ 2"
        )
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    bad = [t for t in types if t not in _HYBRID_TYPES]
    if len(types) != num_layers or bad:
        raise ModelError(
            f"{where}: layer_types must list {num_layers} of {', '.join(_HYBRID_TYPES)} "
            f"(found {len(types)}{', e.g. ' + repr(bad[0]) if bad else ''})"
        )
    nk, nv = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
    if nv % nk:
        raise ModelError(
            f"{where}: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}"
        )
    return dict(
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        qk_norm=True,
        norm_offset=1.0,
        attn_output_gate=True,
        layer_types=tuple(types),
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )


def _qwen3_5_moe_fields(cfg: dict, where: Path) -> dict[str, Any]:
    """Qwen3.5 / Qwen3.6 MoE's experts (models/qwen3_5_moe.py); transformers' defaults (the
    35B-A3B's) for what is left out."""
    experts, k = int(cfg.get("num_experts", 256)), int(cfg.get("num_experts_per_tok", 8))
    if not 1 <= k <= experts:
        raise ModelError(
            f"{where}: num_experts={experts} with num_experts_per_tok={k}: need 1 ≤ "
            "num_experts_per_tok ≤ num_experts"
        )
    return dict(
        num_experts=experts,
        experts_per_token=k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 512)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 512)),
        router_aux_coef=float(cfg.get("router_aux_loss_coef", 0.001))
        if cfg.get("output_router_logits")
        else 0.0,
    )


def _gemma4_fields(cfg: dict, where: Path, common: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 (text; models/gemma4.py), dense or with the MoE block (enable_moe_block)."""
    key = "hidden_activation" if "hidden_activation" in cfg else "hidden_act"
    _activation(cfg, where, key, "gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention"):
        raise ModelError(
            f"{where}: use_bidirectional_attention={cfg['use_bidirectional_attention']!r} is not "
            "supported"
        )
    num_layers = common["num_layers"]
    types = _layer_types(cfg, where, num_layers, 6)
    if types[-1] != "full_attention":  # as transformers forces it
        types = (*types[:-1], "full_attention")
    # the full layers' head size and key/value heads: per_layer_config as transformers writes
    # it, else global_head_dim / num_global_key_value_heads (the latter with attention_k_eq_v)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    given = per_layer.get(full[0]) or {}  # (keys as written: "5" or "05")
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    global_hs = int(given.get("head_dim", cfg.get("global_head_dim", 512)))
    global_kv = given.get("num_key_value_heads")
    if global_kv is None and k_eq_v:
        global_kv = cfg.get("num_global_key_value_heads")
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if shared and set(types[num_layers - shared :]) - set(types[: num_layers - shared]):
        raise ModelError(
            f"{where}: num_kv_shared_layers={shared} leaves a layer type no earlier layer gives "
            "keys and values to"
        )
    field, rope = _rope_dict(cfg)
    if "full_attention" not in rope:
        rope = {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }  # fmt: skip
    full_rope = dict(rope.get("full_attention") or {})
    if full_rope.get("rope_type", "default") not in ("proportional", "default"):
        raise ModelError(
            f"{where}: {field} (full_attention) type {full_rope['rope_type']!r} is not supported "
            "(only proportional or default)"
        )
    local_theta, _ = _rope(
        dict(rope.get("sliding_attention") or {}), {}, where, f"{field} (sliding_attention)", ()
    )
    scaling = (
        ("factor", float(full_rope.get("factor", 1.0))),
        ("partial_rotary_factor", float(full_rope.get("partial_rotary_factor", 1.0))),
        ("rope_type", "proportional"),
    )
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    experts, k = 0, 0
    if cfg.get("enable_moe_block"):  # 26B-A4B: experts beside every block's dense MLP
        experts, k = int(cfg.get("num_experts") or 0), int(cfg.get("top_k_experts") or 0)
        if experts < 1 or not 1 <= k <= experts or not cfg.get("moe_intermediate_size"):
            raise ModelError(
                f"{where}: enable_moe_block needs num_experts ≥ 1, 1 ≤ top_k_experts ≤ "
                f"num_experts and moe_intermediate_size (found {experts}, {k}, "
                f"{cfg.get('moe_intermediate_size')})"
            )
    return dict(
        num_experts=experts,
        experts_per_token=k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        norm_offset=0.0,
        embed_scale=int(cfg["hidden_size"]) ** 0.5,
        attn_scale=1.0,
        final_softcap=_float_or_none(cfg.get("final_logit_softcapping")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        qk_norm=True,
        layer_types=types,
        rope_theta=float(full_rope.get("rope_theta", 1e6)),
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        global_head_dim=global_hs,
        num_global_kv_heads=int(global_kv) if global_kv else 0,
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=shared,
        double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        per_layer_dim=ple,
        per_layer_vocab=int(cfg.get("vocab_size_per_layer_input") or 0) if ple else 0,
    )
