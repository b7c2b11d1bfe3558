"""Gemma 4 dense (models/gemma4.py) against transformers + peft (fp32, 1e-5): per-layer
embeddings, blocks reusing earlier blocks' keys and values, sliding and full layers with their
own head sizes, unpacked and packed; the train → PEFT → export round trip; the image-text
checkpoint's language model."""

from __future__ import annotations

import pytest
import torch

from appliance import models
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from appliance.errors import ModelError
from appliance.models.hf_checkpoint import (
    SafetensorsCheckpoint,
    expected_shapes,
    read_model_args,
    skipped_notes,
)
from appliance.models.lora import LoraSpec
from tests.engine.test_engine_parity import assert_gradients_match, peft_reference, reference_loss
from tests.helpers_model import (
    batch,
    lora_with_random_b,
    make_model,
    rel_err,
    write_config,
)
from tests.models.test_qwen3_5 import assert_round_trip

RTOL = 1e-5
SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gemma4") / "model", "gemma4-ple-kv-shared")


def test_the_model_reads_as_transformers_builds_it(gemma4):
    args = read_model_args(gemma4)
    headers = SafetensorsCheckpoint(gemma4).headers()
    assert expected_shapes(args) == {name: shape for name, (shape, _) in headers.items()}
    assert [args.attention_heads(i) for i in range(5)] == [(2, 16), (1, 32), (2, 16), (2, 16),
                                                           (1, 32)]  # fmt: skip
    assert [args.kv_shared(i) for i in range(5)] == [False, False, False, True, True]
    lora = lora_with_random_b(args, SPEC)
    # values are the keys in full layers; KV-shared blocks have no k/v projection
    assert "self_attn.v_proj" not in lora.blocks[1] and "self_attn.k_proj" in lora.blocks[1]
    assert not {"self_attn.k_proj", "self_attn.v_proj"} & set(lora.blocks[3])
    assert lora.blocks[3]["mlp.gate_proj"][1].shape == (224, 4)  # double-wide
    # the per-layer table stays in host memory: the engine's device globals do not hold it
    engine = StreamedEngine(DictBlockSource.from_hf(gemma4, torch.float32), lora)
    assert models.HOST_GLOBALS[0] in engine.weights.host_globals
    assert models.HOST_GLOBALS[0] not in engine.weights.globals


def test_loss_and_every_lora_gradient_match_transformers_with_peft(gemma4, tmp_path):
    """T = 20 > the window (8); the store blocks' k/v adapters take the reusing blocks' share."""
    source = DictBlockSource.from_hf(gemma4, torch.float32)
    lora = lora_with_random_b(source.args, SPEC)
    ref = peft_reference(gemma4, lora, tmp_path)
    ids, labels = batch(4, 20)
    engine = StreamedEngine(source, lora, grad_clip=None)
    loss, _, _ = engine.forward_backward([(ids[:2], labels[:2]), (ids[2:], labels[2:])], 0)
    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)


def test_a_packed_batch_equals_its_documents_one_by_one(gemma4, tmp_path):
    source = DictBlockSource.from_hf(gemma4, torch.float32)
    lora = lora_with_random_b(source.args, SPEC)
    ref = peft_reference(gemma4, lora, tmp_path)
    ids, labels = batch(1, 30, seed=3)
    lengths = [12, 18]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    segments = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])[None]
    loss, n_target, _ = StreamedEngine(source, lora, grad_clip=None).forward_backward(
        [(ids, labels, (positions, segments))], 0
    )
    ref_loss = torch.zeros(())
    for part in (slice(0, 12), slice(12, 30)):
        n_doc = int((labels[:, part] != -100).sum())
        ref_loss = ref_loss + reference_loss(ref, ids[:, part], labels[:, part]) * n_doc
    ref_loss = ref_loss / n_target
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)


def test_train_then_peft_load_then_export_round_trip(gemma4, tmp_path):
    assert_round_trip(gemma4, SPEC, tmp_path, seq_len=24)


def test_the_image_text_checkpoint_trains_its_language_model(tmp_path):
    model_dir = make_model(tmp_path / "model", "gemma4-vlm", with_tokenizer=False)
    args = read_model_args(model_dir)
    assert (args.architecture, args.language_model_of) == (
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
    )
    notes = skipped_notes(SafetensorsCheckpoint(model_dir), args)
    assert any("vision tower tensors not read" in n for n in notes), notes
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, SPEC)
    ids, _ = batch(2, 20)
    ours = StreamedEngine(source, lora).logits(ids)
    with torch.no_grad():
        theirs = peft_reference(model_dir, lora, tmp_path)(input_ids=ids).logits.float()
    assert rel_err(ours, theirs) < RTOL


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=32),
         "enable_moe_block needs num_experts ≥ 1, 1 ≤ top_k_experts ≤ num_experts and "
         "moe_intermediate_size (found 4, 5, 32)"),
        (dict(use_bidirectional_attention="all"),
         "use_bidirectional_attention='all' is not supported"),
    ],
)  # fmt: skip
def test_what_gemma4_cannot_run_is_refused_by_name(tmp_path, changes, message):
    model_dir = write_config(tmp_path / "model", "Gemma4ForCausalLM", **changes)
    with pytest.raises(ModelError) as e:
        read_model_args(model_dir)
    assert f"{model_dir / 'config.json'}: {message}" in str(e.value)


def test_the_gemma4_31b_preset_has_its_size_and_runs_shrunk():
    """gemma-4-31B's language model: 30.7B parameters; a shrunk copy (global heads twice the
    sliding ones, values = keys) runs a streamed step on synthetic weights."""
    import dataclasses
    import math

    from appliance.bench.synthetic import SyntheticBlockSource
    from appliance.models.lora import LoraWeights
    from appliance.models.presets import PRESETS

    args = PRESETS["gemma4-31b"].args
    assert abs(models.param_count(args) / 30.7e9 - 1) < 0.01
    tiny = dataclasses.replace(
        args, vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4,
        num_kv_heads=2, head_dim=16, global_head_dim=32, num_global_kv_heads=1, sliding_window=16,
        embed_scale=8.0,
    )  # fmt: skip
    src = SyntheticBlockSource(tiny, torch.float32)
    assert {k: tuple(t.shape) for k, t in src.block(5).items()} == models.block_shapes(tiny, 5)
    ids = torch.randint(0, 128, (2, 32))
    stats = StreamedEngine(src, LoraWeights(tiny, SPEC)).train_step([(ids, ids)], 1e-3)
    assert math.isfinite(stats.loss)


def test_the_plan_keeps_the_per_layer_table_on_the_host_and_counts_the_state(gemma4):
    """The weight store holds the per-layer table, the device plan does not; the device plan
    counts each micro-batch's per-layer inputs and shared K/V (models.state_bytes)."""
    from appliance.plan.estimate import globals_bytes

    args = read_model_args(gemma4)
    table = 64 * 5 * 8 * 4  # per_layer_vocab × layers × per_layer_dim, fp32
    assert globals_bytes(args, 4) - globals_bytes(args, 4, device=True) == table
    # per token: 5 × 8 per-layer values; K and V of the sliding store (2 × 16) and of the full
    # store (1 × 32)
    assert models.state_bytes(args, 2, 10, 4) == 2 * 10 * (5 * 8 + 2 * 2 * 16 + 2 * 32) * 4
