"""Qwen3.5 dense (models/qwen3_5.py) and its Gated DeltaNet layers (models/gated_deltanet.py):
the chunked rule against transformers' torch forms, and the streamed step against transformers
+ peft on a tiny model mixing linear and full attention, unpacked and packed (fp32, 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from appliance import models
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from appliance.errors import ModelError
from appliance.models import gated_deltanet
from appliance.models.hf_checkpoint import (
    SafetensorsCheckpoint,
    expected_shapes,
    read_model_args,
    skipped_notes,
)
from appliance.models.lora import LoraSpec, LoraWeights
from tests.engine.test_engine_parity import (
    assert_gradients_match,
    peft_reference,
    reference_loss,
)
from tests.helpers_model import batch, lora_with_random_b, make_model, rel_err, write_config

RTOL = 1e-5
# every target a Qwen3.5 block has: full attention's, linear attention's (PEFT's names), MLP's
TARGETS = ("q", "k", "v", "o", *gated_deltanet.TARGET_MODULES, "gate", "up", "down")
SPEC = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)


def _rule_inputs(seed: int = 0, D=2, L=150, nk=2, nv=4, dk=16, dv=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(D, L, nk, dk, generator=g),
        torch.randn(D, L, nk, dk, generator=g),
        torch.randn(D, L, nv, dv, generator=g),
        -torch.rand(D, L, nv, generator=g),
        torch.rand(D, L, nv, generator=g),
    )


def test_the_chunked_rule_and_its_gradients_equal_transformers_torch_forms():
    """Three chunks (150 tokens, the last padded), key heads serving two value heads each: the
    output equals transformers' chunked form bit for bit and its token-by-token recurrence to
    fp32 rounding; the gradients of every input equal the recurrence's through autograd."""
    inputs = _rule_inputs()
    ours = gated_deltanet.gated_delta_rule(*inputs)
    chunked, _ = hf.torch_chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
    assert torch.equal(ours, chunked)
    grads = []
    for rule in (gated_deltanet.gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        xs = [t.clone().requires_grad_(True) for t in inputs]
        kw = {} if rule is gated_deltanet.gated_delta_rule else {"use_qk_l2norm_in_kernel": True}
        out = rule(*xs, **kw)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out) + out.detach())
        grads.append((out.detach(), [x.grad for x in xs]))
    (o1, g1), (o2, g2) = grads
    assert rel_err(o1, o2) < RTOL
    for a, b in zip(g1, g2, strict=True):
        assert rel_err(a, b) < RTOL


def test_a_packed_document_runs_as_if_alone_in_the_layer():
    """Neither the convolution's nor the recurrence's state crosses a document boundary: each
    document of a packed row gives the output it gives alone; without the mask it does not."""
    from appliance.models import layers

    args = read_model_args_like()
    g = torch.Generator().manual_seed(2)
    w = {k: torch.randn(s, generator=g) * 0.3 for k, s in models.block_shapes(args, 0).items()}
    x = torch.randn(1 * 20, args.hidden_size, generator=g)
    segments = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4])
    mask = layers.document_mask(segments)
    packed = gated_deltanet.linear_attention(x, w, args, None, 20, mask)
    for s, e in ((0, 7), (7, 16), (16, 20)):
        alone = gated_deltanet.linear_attention(x[s:e], w, args, None, e - s)
        torch.testing.assert_close(packed[s:e], alone, rtol=1e-5, atol=1e-6)
    plain = gated_deltanet.linear_attention(x, w, args, None, 20)
    assert not torch.allclose(plain[7:16], packed[7:16], atol=1e-4)


def read_model_args_like():
    from tests.helpers_model import QWEN3_5_HYBRID, VOCAB

    return models.layers.ModelArgs(
        architecture="Qwen3_5ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, max_position_embeddings=256, qk_norm=True, norm_offset=1.0,
        attn_output_gate=True, partial_rotary_factor=0.25,
        layer_types=tuple(QWEN3_5_HYBRID["layer_types"]), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel=4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3_5") / "model", "qwen3_5-hybrid")


def test_loss_and_every_lora_gradient_match_transformers_with_peft(hybrid, tmp_path):
    """80 tokens: two chunks of the rule; LoRA on every projection, linear attention's too."""
    headers = SafetensorsCheckpoint(hybrid).headers()
    expected = expected_shapes(read_model_args(hybrid))
    assert expected == {name: shape for name, (shape, _) in headers.items()}
    source = DictBlockSource.from_hf(hybrid, torch.float32)
    lora = lora_with_random_b(source.args, SPEC)
    assert set(lora.blocks[0]) == {
        *gated_deltanet.LINEARS, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
    }  # fmt: skip
    assert "self_attn.q_proj" in lora.blocks[1] and "linear_attn.out_proj" not in lora.blocks[1]
    ref = peft_reference(hybrid, lora, tmp_path)
    ids, labels = batch(2, 80)
    loss, _, _ = StreamedEngine(source, lora, grad_clip=None).forward_backward([(ids, labels)], 0)
    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)


def test_a_packed_batch_equals_its_documents_one_by_one(hybrid, tmp_path):
    """Two rows of packed documents (positions restart, segments number them; the second row
    ends in padding) against transformers + peft on each document alone."""
    source = DictBlockSource.from_hf(hybrid, torch.float32)
    lora = lora_with_random_b(source.args, SPEC)
    ref = peft_reference(hybrid, lora, tmp_path)
    ids, labels = batch(2, 40, seed=3)
    lengths = [[11, 22, 7], [30, 10]]  # the last "document" of row 1: padding, as packing pads
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    segments = torch.cat(
        [torch.cat([torch.full((n,), s) for s, n in enumerate(row)])[None] for row in lengths]
    )
    segments[1, 30:] = -1
    labels[1, 30:] = -100
    loss, n_target, _ = StreamedEngine(source, lora, grad_clip=None).forward_backward(
        [(ids, labels, (positions, segments))], 0
    )
    ref_loss = torch.zeros(())
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            if not (r == 1 and start == 30):
                part = slice(start, start + n)
                doc_ids, doc_labels = ids[r : r + 1, part], labels[r : r + 1, part]
                n_doc = int((doc_labels != -100).sum())
                ref_loss = ref_loss + reference_loss(ref, doc_ids, doc_labels) * n_doc
            start += n
    ref_loss = ref_loss / n_target
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)


def test_the_image_text_checkpoint_trains_its_language_model_and_names_what_it_skips(tmp_path):
    """Qwen3_5ForConditionalGeneration: the language model's logits equal transformers + peft's
    (the adapter loads on the image-text model); its vision tower and a multi-token-prediction
    head in the files are left out and named."""
    model_dir = make_model(tmp_path / "model", "qwen3_5-vlm", with_tokenizer=False)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)  # as released Qwen3.5 files hold
    save_file(tensors, path, metadata={"format": "pt"})
    args = read_model_args(model_dir)
    assert (args.architecture, args.language_model_of) == (
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
    )
    notes = skipped_notes(SafetensorsCheckpoint(model_dir), args)
    assert len(notes) == 2
    assert "1 multi-token-prediction tensor not read" in notes[0] and "mtp.fc.weight" in notes[0]
    assert "vision tower tensors not read" in notes[1] and "model.visual." in notes[1]
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, SPEC)
    ids, _ = batch(2, 30)
    ours = StreamedEngine(source, lora).logits(ids)
    ref = peft_reference(model_dir, lora, tmp_path)
    with torch.no_grad():
        theirs = ref(input_ids=ids).logits.float()
    assert rel_err(ours, theirs) < RTOL


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["Qwen3NextForCausalLM"], num_experts=8),
         "architecture ['Qwen3NextForCausalLM'] is a mixture-of-experts model whose routing is "
         "not implemented; supported mixture-of-experts models: Qwen3MoeForCausalLM"),
        (dict(architectures=["Qwen3_5MoeForCausalLM"], num_experts=4, num_experts_per_tok=5),
         "num_experts=4 with num_experts_per_tok=5: need 1 ≤ num_experts_per_tok ≤ num_experts"),
        (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
         "layer_types must list 3 of linear_attention, full_attention (found 3, e.g. "
         "'sliding_attention')"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ],
)  # fmt: skip
def test_what_qwen3_5_cannot_run_is_refused_by_name(tmp_path, changes, message):
    model_dir = write_config(tmp_path / "model", "Qwen3_5ForCausalLM", **changes)
    with pytest.raises(ModelError) as e:
        read_model_args(model_dir)
    assert f"{model_dir / 'config.json'}: {message}" in str(e.value)


def test_a_config_without_layer_types_takes_every_fourth_layer_full(tmp_path):
    model_dir = write_config(
        tmp_path / "model", "Qwen3_5ForCausalLM", layer_types=None, num_hidden_layers=8
    )
    assert json.loads((model_dir / "config.json").read_text()).get("layer_types") is None
    args = read_model_args(model_dir)
    assert args.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)


def test_train_then_peft_load_then_export_round_trip(hybrid, tmp_path):
    assert_round_trip(hybrid, SPEC, tmp_path, seq_len=70)  # 70: past one chunk of the rule


def assert_round_trip(model_dir, spec: LoraSpec, tmp_path, seq_len: int) -> None:
    """Two optimizer steps of the streamed engine; the adapter file loads in PEFT on the
    transformers model with no missing or unexpected key and gives the engine's logits; `export`
    merges it into a checkpoint that plain transformers loads and that gives them too (also
    tests/models/test_gemma4.py)."""
    from peft import PeftModel

    from appliance.adapter.export import export_merged
    from tests.helpers_model import load_hf

    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, spec)
    engine = StreamedEngine(source, lora)
    for step in range(2):
        ids, labels = batch(4, 20, seed=20 + step)
        engine.train_step([(ids[:2], labels[:2]), (ids[2:], labels[2:])], lr=1e-2)
    lora.save(tmp_path / "adapter")
    peft = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter").eval()
    again = peft.load_adapter(tmp_path / "adapter", adapter_name="again")
    assert again.missing_keys == [] and again.unexpected_keys == []
    ids, _ = batch(2, seq_len, seed=99)
    ours = engine.logits(ids)
    with torch.no_grad():
        theirs = peft(input_ids=ids).logits.float()
        merged = load_hf(export_merged(model_dir, tmp_path / "adapter", tmp_path / "out"))(
            input_ids=ids
        ).logits.float()
        base = load_hf(model_dir)(input_ids=ids).logits.float()
    assert rel_err(ours, theirs) < RTOL
    assert rel_err(merged, theirs) < RTOL
    assert rel_err(base, theirs) > 1e-3  # the adapter matters


def test_the_qwen3_6_27b_preset_counts_its_linear_attention_and_runs_shrunk():
    """The preset is Qwen3.6-27B's language model (26.9B of the published 27B, which counts the
    vision tower and the MTP head too); the step's FLOPs add the chunked rule of its 48 linear
    layers to 6·N·T; a shrunk copy runs a streamed step on synthetic weights of each kind."""
    import dataclasses
    import math

    from appliance.bench.synthetic import SyntheticBlockSource
    from appliance.engine.flops import step_flops
    from appliance.models.presets import PRESETS

    args = PRESETS["qwen3.6-27b"].args
    assert abs(models.param_count(args) / 26.9e9 - 1) < 0.01
    six_nt = 6.0 * models.blocks_param_count(args) * 2048
    rule = 4 * 48 * gated_deltanet.rule_flops(args, 2048)
    f = step_flops(args, [(1, 2048)])
    assert (f.blocks, f.linear_attention) == (six_nt, rule) and 0.005 < rule / six_nt < 0.05
    tiny = dataclasses.replace(
        args, vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, layer_types=args.layer_types[:4], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    src = SyntheticBlockSource(tiny, torch.float32)
    for i in (0, 3):  # a linear and a full block
        assert {k: tuple(t.shape) for k, t in src.block(i).items()} == models.block_shapes(tiny, i)
    ids = torch.randint(0, 128, (2, 70))
    stats = StreamedEngine(src, LoraWeights(tiny, SPEC)).train_step([(ids, ids)], 1e-3)
    assert math.isfinite(stats.loss)
