"""The floor's F (engine/flops.py) against hand counts for tiny configs, and against
torch.utils.flop_counter's count of the transformers + PEFT reference's forward and backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from appliance import models
from appliance.engine.flops import (
    causal_pairs,
    elementwise_bytes,
    lora_active_params,
    step_flops,
)
from appliance.models import gated_deltanet
from appliance.models.presets import PRESETS

# a Llama with GQA: 4 query heads of 16, 2 KV heads; two blocks
LLAMA = dataclasses.replace(
    PRESETS["tiny"].args, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def test_causal_pairs_count_each_query_s_keys():
    for T, w in ((1, None), (7, None), (10, 4), (10, 10), (10, 12), (5, 1)):
        brute = sum(min(t + 1, w or T) for t in range(T))
        assert causal_pairs(T, w) == brute


def test_a_dense_gqa_step_equals_the_hand_count():
    # per block: q, o 64×64; k, v 32×64 (2 KV heads of 16); gate, up, down 64×128; 2 norms
    n = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64)
    lora = 2 * 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)  # r = 4, all seven
    shapes = [(2, 16), (1, 8)]
    T = 2 * 16 + 8
    pairs = 2 * 16 * 17 // 2 + 8 * 9 // 2  # causal: t + 1 keys for query t
    attention = 2 * 16 * pairs * 4 * 16  # 2 blocks, (QKᵀ + PV)·2 × 4 passes, 4 heads of 16
    head = 4 * 256 * 64 * T
    f = step_flops(LLAMA, shapes, lora_params=lora_active_params(LLAMA, 4, ALL))
    assert lora_active_params(LLAMA, 4, ALL) == lora
    assert f.as_dict() == {
        "blocks": 6 * n * T, "lora": 8 * lora * T, "attention": attention,
        "linear_attention": 0, "head": head, "total": 6 * n * T + 8 * lora * T + attention + head,
    }  # fmt: skip


def test_sliding_window_blocks_count_their_window_and_gemma4_s_wider_full_blocks():
    args = dataclasses.replace(
        LLAMA, num_layers=3, sliding_window=4,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        global_head_dim=32,
    )  # fmt: skip
    f = step_flops(args, [(1, 10)])
    sliding = 4 * 5 // 2 + 6 * 4  # queries 0..3 see t + 1 keys, the other 6 see 4
    full = 10 * 11 // 2
    assert f.attention == 16 * (2 * sliding * 4 * 16 + full * 4 * 32)


def test_qwen3_5_counts_attention_on_its_full_blocks_and_the_rule_on_the_others():
    args = PRESETS["qwen3.6-27b"].args
    L = args.num_layers
    full = [i for i in range(L) if args.layer_types[i] != "linear_attention"]
    f = step_flops(args, [(1, 2048)])
    assert f.linear_attention == 4 * (L - len(full)) * gated_deltanet.rule_flops(args, 2048)
    width = args.num_heads * args.head_dim
    assert f.attention == 16 * len(full) * causal_pairs(2048) * width
    assert f.blocks == 6 * models.blocks_param_count(args) * 2048
    assert 0.005 < f.linear_attention / f.blocks < 0.05


def test_moe_counts_the_active_experts_and_their_adapters():
    args = dataclasses.replace(
        PRESETS["qwen3-30b-a3b"].args, vocab_size=128, hidden_size=32, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8, experts_per_token=2,
        moe_intermediate_size=24,
    )  # fmt: skip
    f = step_flops(args, [(1, 8)], lora_params=lora_active_params(args, 4, ("experts",)))
    expert = 3 * 32 * 24
    active = models.block_param_count(args) - 6 * expert  # 2 of the 8 experts, the router
    assert f.blocks == 6 * 2 * active * 8
    # the experts' adapters: gate_up (2·24 × 32) and down (32 × 24), for 2 experts of 8
    assert f.lora == 8 * 2 * 4 * 2 * ((2 * 24 + 32) + (32 + 24)) * 8


def test_a_full_fine_tune_counts_the_weight_gradients_and_a_trained_head():
    shapes = [(1, 16)]
    lora = step_flops(LLAMA, shapes, lora_params=100)
    full = step_flops(LLAMA, shapes, full=True, head_trained=True)
    frozen = step_flops(LLAMA, shapes, full=True, head_trained=False)
    assert full.blocks == lora.blocks * 8 / 6 and full.lora == 0
    assert full.attention == lora.attention
    assert full.head == lora.head * 6 / 4 and frozen.head == lora.head


def test_elementwise_bytes_count_each_pass_once():
    per_block = 4 * 64 + 2 * (4 + 2) * 16 + 3 * 128 + 6 * 64  # norms, RoPE, act, residuals
    expected = 3 * 2 * per_block * 2 * 24 + 12 * 256 * 24  # 3 passes, bf16, 2 blocks; the loss
    assert elementwise_bytes(LLAMA, [(1, 16), (1, 8)], 2) == expected


def test_f_matches_the_reference_s_flop_counter():
    """FlopCounterMode counts every matmul transformers + PEFT run in a forward and backward
    (eager attention: the whole T×T square; no recompute). F's parts, read back to that work:
    the blocks' 4 of 6 passes, LoRA's 6 of 8, attention's 3 of 4 at T² pairs, the head whole.
    Within 1%: F's N counts the norms' weights too (0.3% here)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torch.utils.flop_counter import FlopCounterMode

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    T = 24
    ids = torch.randint(0, 256, (2, T))
    # inputs that need a gradient: block 0's input gradients are made, as in the engine
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        model(inputs_embeds=embeds, labels=ids).loss.backward()
    f = step_flops(LLAMA, [(2, T)], lora_params=lora_active_params(LLAMA, 4, ALL))
    read_back = (
        f.blocks * 4 / 6 + f.lora * 6 / 8 + f.attention * 3 / 4 * T * T / causal_pairs(T) + f.head
    )
    assert counter.get_total_flops() == pytest.approx(read_back, rel=0.01)
