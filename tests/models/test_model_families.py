"""Model families (appliance/models/): what each reads from config.json and its checkpoint, and
what is refused by name. Their numerics are proven in tests/engine/test_engine_parity.py
(FAMILY_VARIANTS)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from appliance import models, quant
from appliance.errors import ConfigError, ModelError
from appliance.models.hf_checkpoint import SafetensorsCheckpoint, expected_shapes, read_model_args
from tests.helpers_model import FAMILY_VARIANTS, MOE_VARIANTS, make_model, write_config


@pytest.mark.parametrize("variant", FAMILY_VARIANTS + MOE_VARIANTS)
def test_every_tensor_of_the_checkpoint_is_read_with_the_shape_config_json_implies(
    variant, tmp_path
):
    model_dir = make_model(tmp_path / "model", variant, with_tokenizer=False)
    args = read_model_args(model_dir)
    headers = SafetensorsCheckpoint(model_dir).headers()
    if args.language_model_of:  # the vision tower and projector are there, and not read
        others = {n for n in headers if n.startswith(("vision_tower.", "multi_modal_projector."))}
        assert others and all(not n.startswith(("model.", "lm_head")) for n in others)
        headers = {n: h for n, h in headers.items() if n not in others}
    assert expected_shapes(args) == {name: shape for name, (shape, _) in headers.items()}
    # quantization covers every linear weight (the block's 2-D tensors), fused ones and a MoE
    # block's experts stored apart included, not its router (nor gpt-oss's (E, out) biases)
    linear = models.linear_weight_names(args)
    two_d = {n for n, s in models.block_shapes(args).items() if len(s) == 2}
    two_d = {n for n in two_d if not n.endswith("_bias")}
    routers = {n for n in two_d if n in ("mlp.gate.weight", "block_sparse_moe.gate.weight",
                                         "mlp.router.weight")}  # fmt: skip
    assert set(linear) == two_d - routers
    assert all(quant.is_linear_weight(n) for n in linear)


@pytest.mark.parametrize("variant", ["llama-mha", *(v for v in FAMILY_VARIANTS if "vlm" not in v)])
def test_a_config_without_architectures_is_read_by_its_model_type(variant, tmp_path):
    """A config.json with `model_type` but no `architectures` (older exports, hand-written ones)
    loads in transformers' AutoModelForCausalLM; it was refused as "architecture 'llama' is not
    supported"."""
    import json

    model_dir = make_model(tmp_path / "model", variant, with_tokenizer=False)
    named = read_model_args(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    del config["architectures"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert read_model_args(model_dir) == named


def test_an_eos_id_config_json_lacks_is_taken_where_transformers_finds_it(tmp_path):
    """config.json without eos_token_id was refused ("packing needs one") although
    generation_config.json or the tokenizer's eos_token names it."""
    import json

    model_dir = make_model(tmp_path / "model", "llama-mha")
    eos = read_model_args(model_dir).eos_token_id
    config = json.loads((model_dir / "config.json").read_text())
    del config["eos_token_id"]
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 0]}))
    assert read_model_args(model_dir).eos_token_id == eos
    (model_dir / "generation_config.json").unlink()
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    [token] = [t["content"] for t in tokenizer["added_tokens"] if t["id"] == eos]
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": token}))
    assert read_model_args(model_dir).eos_token_id == eos
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<none>"}))
    assert read_model_args(model_dir).eos_token_id is None


def test_shards_without_their_index_are_named_as_that(tmp_path):
    """Shards whose index is missing were told to save with safe_serialization=True."""
    model_dir = make_model(tmp_path / "model", "llama-mha", shards=True, with_tokenizer=False)
    shards = sorted(model_dir.glob("model-*-of-*.safetensors"))
    (model_dir / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelError) as e:
        SafetensorsCheckpoint(model_dir)
    assert str(e.value) == (
        f"{model_dir}: {len(shards)} safetensors shards ({shards[0].name}, ...) but no "
        "model.safetensors.index.json, which says which tensor is in which shard: download it "
        "again with the shards"
    )


def test_phi3_fused_modules_are_the_llama_targets_they_stand_for(tmp_path):
    args = read_model_args(make_model(tmp_path / "model", "phi3-partial-longrope"))
    assert args.partial_rotary_factor == 0.5
    resolve = models.resolve_targets
    assert resolve(args, ("q", "k", "v", "o", "gate", "up", "down")) == (
        "qkv",
        "o",
        "gate_up",
        "down",
    )
    assert resolve(args, ("qkv", "down")) == ("qkv", "down")
    with pytest.raises(ConfigError, match=r"--lora-targets q,v: Phi3ForCausalLM fuses q,k,v"):
        resolve(args, ("q", "v", "o"))
    llama = dataclasses.replace(args, architecture="LlamaForCausalLM", partial_rotary_factor=1.0)
    with pytest.raises(ConfigError, match=r"--lora-targets qkv: LlamaForCausalLM has no such"):
        resolve(llama, ("qkv", "o"))


def test_gemma3_configs_of_either_transformers_generation_read_the_same(tmp_path):
    """transformers ≥5 nests rope settings per layer type; hub files of the 4.x era give
    rope_theta, rope_scaling, rope_local_base_freq and a sliding_window_pattern instead."""
    new = read_model_args(make_model(tmp_path / "new", "gemma3-local-rope", with_tokenizer=False))
    old_dir = write_config(
        tmp_path / "old",
        "Gemma3ForCausalLM",
        rope_parameters=None,
        layer_types=None,
        _sliding_window_pattern=None,
        rope_theta=1e5,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_local_base_freq=100.0,
        sliding_window_pattern=2,
        sliding_window=8,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        rms_norm_eps=1e-5,
    )
    old = read_model_args(old_dir)
    assert old == new
    assert new.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (new.rope_theta, new.rope_local_theta) == (1e5, 100.0)
    assert new.local_rope(0) and not new.local_rope(1)
    assert (new.window(0), new.window(1)) == (8, None)


@pytest.mark.parametrize(
    "arch, changes, message",
    [
        ("LlamaForCausalLM", dict(architectures=["Glm4MoeForCausalLM"], n_routed_experts=8),
         "architecture ['Glm4MoeForCausalLM'] is a mixture-of-experts model whose routing is "
         "not implemented; supported mixture-of-experts models: Qwen3MoeForCausalLM, "
         "MixtralForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM, GptOssForCausalLM, "
         "Qwen3_5MoeForCausalLM"),
        ("Qwen2MoeForCausalLM", dict(mlp_only_layers=[1]), "mlp_only_layers (dense blocks"),
        ("LlamaForCausalLM", dict(architectures=["DeepseekV3ForCausalLM"], n_routed_experts=64),
         "architecture ['DeepseekV3ForCausalLM'] is a mixture-of-experts model whose routing"),
        ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[1]), "mlp_only_layers (dense blocks"),
        ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
        ("Qwen3MoeForCausalLM", dict(num_experts_per_tok=200), "num_local_experts=128 with "
         "num_experts_per_tok=200"),
        ("MixtralForCausalLM", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
        ("GptOssForCausalLM", dict(quantization_config={"quant_method": "fp8"}),
         "quantization_config (quant_method 'fp8') is not supported; supported: the released "
         "MXFP4 experts"),
        ("GptOssForCausalLM", dict(swiglu_limit=8.0), "swiglu_limit=8.0 is not supported"),
        ("LlamaForCausalLM", dict(architectures=["LlavaForConditionalGeneration"],
                                  vision_config={"model_type": "clip_vision_model"}),
         "architecture ['LlavaForConditionalGeneration'] has a vision tower; supported are "
         "text-only causal LMs and the language model of Gemma3ForConditionalGeneration and "
         "Mistral3ForConditionalGeneration"),
        ("Qwen3ForCausalLM", dict(use_sliding_window=True), "use_sliding_window=true"),
        ("Gemma2ForCausalLM", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True),
         "use_bidirectional_attention=true"),
        ("Gemma2ForCausalLM", dict(layer_types=["sliding_attention"]),
         "layer_types must list 3 of sliding_attention, full_attention (found 1)"),
        ("Phi3ForCausalLM", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
         "rope_parameters type 'linear' is not supported (only longrope or none)"),
        ("Phi3ForCausalLM", dict(partial_rotary_factor=0.5625, rope_parameters=None),
         "partial_rotary_factor=0.5625 gives 9 rotated dimensions per head"),
    ],
)  # fmt: skip
def test_unsupported_models_are_refused_by_name_before_any_weight(tmp_path, arch, changes, message):
    model_dir = write_config(tmp_path / "model", arch, **changes)  # config.json only: no weights
    with pytest.raises(ModelError) as e:
        read_model_args(model_dir)
    assert f"{model_dir / 'config.json'}: {message}" in str(e.value)


def test_attention_kernels_agree_where_their_domains_meet():
    """The masked and written-out kernels equal SDPA's causal fast path when the window covers
    the sequence and the cap is too high to bite."""
    from appliance.models.layers import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 12, 8, generator=g) for n in (4, 2, 2))
    fast = attend(q, k, v)
    assert torch.allclose(attend(q, k, v, window=12), fast)
    assert torch.allclose(attend(q, k, v, softcap=1e6), fast, atol=1e-6)
    assert torch.allclose(
        attend(q, k, v, window=4, softcap=1e6), attend(q, k, v, window=4), atol=1e-6
    )
    assert not torch.allclose(attend(q, k, v, window=4), fast)


@pytest.mark.parametrize("softcap", [None, 1.0])
def test_a_document_mask_makes_a_packed_document_attend_as_if_alone(softcap):
    """model.attend's `mask` (packed documents) composes with the window and the soft cap."""
    from appliance.models.layers import attend

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 12, 8, generator=g) for n in (4, 2, 2))
    segments = torch.tensor([[0] * 5 + [1] * 7])
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]  # (1, 1, T, T)
    packed = attend(q, k, v, window=4, softcap=softcap, mask=mask)
    alone = attend(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], window=4, softcap=softcap)
    torch.testing.assert_close(packed[:, :, 5:], alone)
    assert not torch.allclose(attend(q, k, v, window=4, softcap=softcap)[:, :, 5:], alone)
