"""The hybrid mixture-of-experts families: Qwen3.5 / Qwen3.6 MoE (models/qwen3_5_moe.py: Gated
DeltaNet and gated full attention, routed experts and a shared expert, moe.shared_expert). The
streamed step equals transformers + PEFT (fp32, 1e-5 relative): loss with the load-balancing
loss, every LoRA gradient (both mixers, the shared expert, the routed experts), unpacked and
packed; a trained adapter loads in PEFT and exports."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance import models
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from appliance.models import gated_deltanet, moe
from appliance.models.hf_checkpoint import SafetensorsCheckpoint, expected_shapes, read_model_args
from appliance.models.lora import LoraSpec, adapter_config, read_spec
from tests.engine.test_engine_parity import (
    RTOL,
    assert_two_micro_batches_match,
    peft_reference,
    reference_loss,
)
from tests.helpers_model import batch, lora_with_random_b, make_model, rel_err
from tests.models.test_moe import (
    assert_packed_rows_equal_them_alone,
    moe_reference_loss,
)
from tests.models.test_qwen3_5 import assert_round_trip

SHARED = ("shared_gate", "shared_up", "shared_down")
# every target a Qwen3.5-MoE block has
EVERYTHING = LoraSpec(
    rank=2,
    alpha=4.0,
    targets=("q", "k", "v", "o", *gated_deltanet.TARGET_MODULES, *SHARED, "experts"),
)


def fuse_experts(model_dir: Path) -> Path:
    """Rewrite a checkpoint's experts stored apart (as save_pretrained writes them) as the fused
    3-D tensors the released Qwen3.5-MoE files hold: gate_up (E, 2I, C), down (E, C, I)."""
    path = model_dir / "model.safetensors"
    tensors, parts = load_file(path), {}
    for name in list(tensors):
        m = re.fullmatch(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            parts.setdefault(m[1], {})[(int(m[2]), m[3])] = tensors.pop(name)
    for prefix, p in parts.items():
        E = 1 + max(j for j, _ in p)
        tensors[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat((p[j, "gate"], p[j, "up"])) for j in range(E)]
        )
        tensors[prefix + "down_proj"] = torch.stack([p[j, "down"] for j in range(E)])
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def split_qwen3_5_moe(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("q35moe") / "model", "qwen3_5-moe")


@pytest.fixture(scope="module")
def qwen3_5_moe(split_qwen3_5_moe, tmp_path_factory):
    """The released layout: experts fused."""
    fused = tmp_path_factory.mktemp("q35moe-fused") / "model"
    return fuse_experts(Path(shutil.copytree(split_qwen3_5_moe, fused)))


@pytest.mark.parametrize("layout", ["fused", "split"])
def test_qwen3_5_moe_loss_and_every_lora_gradient_match_transformers_with_peft(
    layout, request, tmp_path
):
    """Two micro-batches, the load-balancing loss on, LoRA on every target: the full and linear
    attention's projections, the shared expert's linears and the routed experts' tensors; the
    experts fused (as released) or stored apart (as save_pretrained writes them)."""
    model_dir = request.getfixturevalue(
        {"fused": "qwen3_5_moe", "split": "split_qwen3_5_moe"}[layout]
    )
    args = read_model_args(model_dir)
    assert args.fused_experts == (layout == "fused")
    headers = SafetensorsCheckpoint(model_dir).headers()
    assert expected_shapes(args) == {name: shape for name, (shape, _) in headers.items()}
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, EVERYTHING)
    assert set(lora.blocks[0]) == {*gated_deltanet.LINEARS, *moe.SHARED, moe.GATE_UP, moe.DOWN}
    ref = peft_reference(model_dir, lora, tmp_path)
    assert_two_micro_batches_match(source, lora, ref, moe_reference_loss, seq_len=24)


def test_qwen3_5_moe_packed_documents_equal_them_one_by_one(tmp_path):
    """Packed documents through the hybrid MoE blocks (no state of the conv, the recurrence or
    attention crosses a document) equal each document alone, shared and routed experts adapted.
    (The load-balancing loss is off: a statistic of the whole batch, as in test_moe.py.)"""
    model_dir = make_model(
        tmp_path / "model", "qwen3_5-moe", with_tokenizer=False, output_router_logits=False
    )
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, EVERYTHING)
    ref = peft_reference(model_dir, lora, tmp_path)
    assert_packed_rows_equal_them_alone(source, lora, ref, moe_reference_loss)


def test_qwen3_5_moe_train_then_peft_load_then_export_round_trip(qwen3_5_moe, tmp_path):
    assert_round_trip(qwen3_5_moe, EVERYTHING, tmp_path, seq_len=24)


def test_the_qwen3_5_moe_targets_by_default_and_in_the_adapter_file(qwen3_5_moe):
    """The Llama default targets mean both mixers' projections (not the experts); the shared
    expert's linears are named with their parent in target_modules (PEFT's `gate_proj` alone
    would be the dense MLP's name), and read back as the same targets."""
    args = read_model_args(qwen3_5_moe)
    default = models.resolve_targets(args, ("q", "k", "v", "o", "gate", "up", "down"))
    assert default == ("q", "k", "v", "o", *gated_deltanet.TARGET_MODULES)
    cfg = adapter_config(EVERYTHING, args)
    assert {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"} <= set(
        cfg["target_modules"]
    )
    assert "gate_proj" not in cfg["target_modules"]
    assert cfg["target_parameters"] == sorted((moe.GATE_UP, moe.DOWN))


def test_the_qwen3_5_moe_image_text_checkpoint_trains_its_language_model(tmp_path):
    """Qwen3_5MoeForConditionalGeneration, its experts fused as released: the language model's
    logits (shared expert and experts adapted) equal transformers + peft on the whole
    image-text model."""
    model_dir = make_model(tmp_path / "model", "qwen3_5-moe-vlm", with_tokenizer=False)
    args = read_model_args(fuse_experts(model_dir))  # as released: experts fused
    assert args.fused_experts
    assert (args.architecture, args.language_model_of) == (
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    )
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, EVERYTHING)
    assert read_spec(_saved(lora, tmp_path), args).targets == lora.spec.targets
    ids, _ = batch(2, 20)
    ours = StreamedEngine(source, lora).logits(ids)
    ref = peft_reference(model_dir, lora, tmp_path)
    with torch.no_grad():
        theirs = ref(input_ids=ids).logits.float()
    assert rel_err(ours, theirs) < RTOL


def _saved(lora, tmp_path):
    lora.save(tmp_path / "adapter")
    return tmp_path / "adapter"


# ---------------------------------------------------------------- Gemma 4's MoE block

GEMMA4_ALL = LoraSpec(
    rank=2, alpha=4.0, targets=("q", "k", "v", "o", "gate", "up", "down", "experts")
)


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("g4moe") / "model", "gemma4-moe")


def test_gemma4_moe_loss_and_every_lora_gradient_match_transformers_with_peft(gemma4_moe, tmp_path):
    """Sliding and full layers (T = 20 > the window), each block's dense MLP and its experts
    side by side; LoRA on the attention, the dense MLP and the experts (`experts.*`, no `mlp.`)."""
    headers = SafetensorsCheckpoint(gemma4_moe).headers()
    args = read_model_args(gemma4_moe)
    assert expected_shapes(args) == {name: shape for name, (shape, _) in headers.items()}
    source = DictBlockSource.from_hf(gemma4_moe, torch.float32)
    lora = lora_with_random_b(source.args, GEMMA4_ALL)
    assert {"experts.gate_up_proj", "experts.down_proj", "mlp.gate_proj"} <= set(lora.blocks[0])
    ref = peft_reference(gemma4_moe, lora, tmp_path)
    assert_two_micro_batches_match(source, lora, ref, reference_loss, seq_len=20)


def test_gemma4_moe_packed_documents_equal_them_one_by_one(gemma4_moe, tmp_path):
    source = DictBlockSource.from_hf(gemma4_moe, torch.float32)
    lora = lora_with_random_b(source.args, GEMMA4_ALL)
    ref = peft_reference(gemma4_moe, lora, tmp_path)
    assert_packed_rows_equal_them_alone(source, lora, ref, reference_loss)


def test_gemma4_moe_train_then_peft_load_then_export_round_trip(gemma4_moe, tmp_path):
    """The experts' LoRA merges into the fused (E, out, in) tensors as the files store them."""
    assert_round_trip(gemma4_moe, GEMMA4_ALL, tmp_path, seq_len=24)


# ---------------------------------------------------------------- presets

# Qwen3.6-35B-A3B's config.json (text_config of the image-text checkpoint) as released
QWEN3_6_35B_A3B = dict(
    vocab_size=248320, hidden_size=2048, intermediate_size=None, num_hidden_layers=40,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, layer_types=None,
    full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False, output_router_logits=False,
)  # fmt: skip


def test_the_qwen3_6_35b_a3b_preset_is_the_released_model_and_counts_active_parameters(
    tmp_path,
):
    """The preset reads as the released config.json does; 34.7B parameters in the language
    model (the published 35B also counts the vision tower and the MTP head); 2.4B of them a
    token meets in the blocks, plus the LM head 2.9B (published: 3B active); the step's FLOPs
    are 6·N_active·T plus the chunked rule of its 30 linear layers; a shrunk copy runs a
    streamed step on synthetic weights of each kind of block."""
    import dataclasses
    import math

    from appliance.bench.synthetic import SyntheticBlockSource
    from appliance.engine.flops import step_flops
    from appliance.models.lora import LoraWeights
    from appliance.models.presets import PRESETS
    from tests.helpers_model import write_config

    args = PRESETS["qwen3.6-35b-a3b"].args
    read = read_model_args(write_config(tmp_path, "Qwen3_5MoeForCausalLM", **QWEN3_6_35B_A3B))
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert dataclasses.replace(read, **ids) == dataclasses.replace(args, **ids)
    assert abs(models.param_count(args) / 35e9 - 1) < 0.02
    active = models.active_blocks_param_count(args)
    assert abs((active + args.vocab_size * args.hidden_size) / 3e9 - 1) < 0.02
    rule = 4 * 30 * gated_deltanet.rule_flops(args, 2048)
    f = step_flops(args, [(1, 2048)])
    assert (f.blocks, f.linear_attention) == (6.0 * active * 2048, rule)
    tiny = dataclasses.replace(
        args, vocab_size=128, hidden_size=64, intermediate_size=32, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, layer_types=args.layer_types[:4], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
        moe_intermediate_size=16, shared_expert_intermediate_size=32,
    )  # fmt: skip
    src = SyntheticBlockSource(tiny, torch.float32)
    for i in (0, 3):  # a linear and a full block
        assert {k: tuple(t.shape) for k, t in src.block(i).items()} == models.block_shapes(tiny, i)
    ids = torch.randint(0, 128, (2, 40))
    lora = LoraWeights(tiny, LoraSpec(rank=2, targets=("q", "in_proj_qkv", "shared_up", "experts")))
    stats = StreamedEngine(src, lora).train_step([(ids, ids)], 1e-3)
    assert math.isfinite(stats.loss)


# ---------------------------------------------------------------- Qwen2-MoE: the shared expert

QWEN2_ALL = LoraSpec(rank=2, alpha=4.0, targets=("q", "k", "v", "o", *SHARED, "experts"))


def test_qwen2_moe_loss_and_every_lora_gradient_match_then_round_trip(tmp_path):
    """Qwen2-MoE (q/k/v biases, routed experts not renormalised, a shared expert): the loss
    with the load-balancing loss and every LoRA gradient equal transformers + PEFT's; then the
    train → PEFT load → export round trip."""
    model_dir = make_model(tmp_path / "model", "qwen2-moe")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    assert not source.args.norm_topk_prob and source.args.attention_bias
    lora = lora_with_random_b(source.args, QWEN2_ALL)
    assert set(lora.blocks[0]) >= {*moe.SHARED, moe.GATE_UP, moe.DOWN}
    ref = peft_reference(model_dir, lora, tmp_path / "ref")
    assert_two_micro_batches_match(source, lora, ref, moe_reference_loss, seq_len=24)
    assert_round_trip(model_dir, QWEN2_ALL, tmp_path / "trip", seq_len=24)


def test_lora_on_the_experts_of_a_dense_gemma4_is_refused_by_name(tmp_path):
    from appliance.errors import ConfigError
    from tests.helpers_model import write_config

    args = read_model_args(write_config(tmp_path, "Gemma4ForCausalLM"))
    with pytest.raises(ConfigError, match="--lora-targets experts: Gemma4ForCausalLM here has no"):
        models.resolve_targets(args, ("q", "experts"))
