"""The streamed step equals an ordinary full-model autograd step of transformers + peft (fp32, CPU).

Tolerance: 1e-5 relative error (docs/architecture.md, "Numerics that must hold").
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from appliance import models
from appliance.engine.blocks import DictBlockSource
from appliance.engine.schedule import lr_at
from appliance.engine.step import StreamedEngine
from appliance.errors import ModelError
from appliance.models import layers, rope
from appliance.models import lora as lora_module
from appliance.models.hf_checkpoint import SafetensorsCheckpoint, read_block, read_model_args
from appliance.models.lora import LoraSpec, LoraWeights, folds_scale, peft_key, peft_layers
from tests.helpers_model import (
    FAMILY_VARIANTS,
    MOE_VARIANTS,
    SPEC,
    VARIANTS,
    batch,
    load_hf,
    lora_with_random_b,
    make_model,
    rel_err,
    write_config,
)

RTOL = 1e-5


def peft_reference(model_dir, lora: LoraWeights, tmp_path) -> PeftModel:
    lora.save(tmp_path / "adapter")
    return PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter", is_trainable=True)


def reference_loss(model, ids, labels) -> torch.Tensor:
    logits = model(input_ids=ids).logits.float()
    n = (labels != -100).sum()
    return (
        F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        / n
    )


def peft_params(model) -> dict[str, torch.Tensor]:
    """PEFT's LoRA parameters under our (PEFT file) key names."""
    return {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}


def peft_grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad for k, p in peft_params(model).items()}


def assert_gradients_match(lora: LoraWeights, ref: PeftModel) -> None:
    """Every A and B gradient of `lora` equals PEFT's (and PEFT has no other LoRA parameter)."""
    ref_grads = peft_grads(ref)
    checked = 0
    for i, block in enumerate(lora.blocks):
        for module, (A, B) in block.items():
            for which, p in (("A", A), ("B", B)):
                key = peft_key(i, module, which, peft_layers(lora.args))
                assert rel_err(p.grad, ref_grads[key]) < RTOL, key
                checked += 1
    # every block has every target, but in Qwen3.5, whose linear-attention blocks have no q_proj
    assert checked == len(ref_grads) == sum(len(block) for block in lora.blocks) * 2


def assert_two_micro_batches_match(source, lora, ref, reference_loss, seq_len: int) -> None:
    """Four rows of `seq_len` tokens as two micro-batches through the streamed engine: the loss
    and every LoRA gradient equal `ref`'s over the four rows at once."""
    ids, labels = batch(4, seq_len, seed=2)
    engine = StreamedEngine(source, lora, grad_clip=None)
    loss, _, _ = engine.forward_backward([(ids[:2], labels[:2]), (ids[2:], labels[2:])], step=0)
    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)


# the dense variants (the MoE ones add the load-balancing loss: tests/models/test_moe.py,
# test_hybrid_moe.py)
@pytest.fixture(params=[v for v in VARIANTS if v not in MOE_VARIANTS and "moe" not in v])
def variant_dir(request, tmp_path):
    return make_model(tmp_path / "model", request.param, shards=request.param == "mistral")


def test_loss_and_every_lora_gradient_match_transformers_with_peft(variant_dir, tmp_path):
    source = DictBlockSource.from_hf(variant_dir, torch.float32)
    lora = lora_with_random_b(source.args)
    ref = peft_reference(variant_dir, lora, tmp_path)
    ids, labels = batch(4, 24)

    engine = StreamedEngine(source, lora, grad_clip=None)
    loss, n_target, _ = engine.forward_backward([(ids, labels)], step=0)

    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    assert n_target == int((labels != -100).sum())
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)


def test_adapters_on_q_and_v_only_match_peft(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-attn-bias")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, LoraSpec(rank=4, alpha=8.0, targets=("q", "v")))
    ref = peft_reference(model_dir, lora, tmp_path)
    ids, labels = batch(2, 20, seed=8)

    loss, _, _ = StreamedEngine(source, lora).forward_backward([(ids, labels)], step=0)
    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)  # q and v only: PEFT made no other adapter either


@pytest.mark.parametrize(
    "variant, targets",
    [("qwen2-bias", ("q", "o", "down"))]
    + [(v, ("q", "k", "v", "o", "down")) for v in FAMILY_VARIANTS],
)
def test_peft_loads_our_adapter_file_with_no_missing_or_unexpected_key(variant, targets, tmp_path):
    model_dir = make_model(tmp_path / "model", variant)
    spec = LoraSpec(rank=4, alpha=8.0, targets=targets)
    lora = lora_with_random_b(read_model_args(model_dir), spec)
    lora.save(tmp_path / "adapter")
    model = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter")
    result = model.load_adapter(tmp_path / "adapter", adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    loaded = get_peft_model_state_dict(model, adapter_name="again")
    ours = lora.peft_state_dict()
    assert sorted(loaded) == sorted(ours)
    assert all(torch.equal(loaded[k], ours[k]) for k in ours)


def test_four_micro_batches_equal_one_batch_of_four(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    ids, labels = batch(4, 20, seed=3)
    labels[2, :] = -100  # uneven target counts per micro-batch: normalisation must be global

    one = StreamedEngine(source, lora_with_random_b(source.args))
    four = StreamedEngine(source, lora_with_random_b(source.args))
    loss1, _, _ = one.forward_backward([(ids, labels)], step=0)
    loss4, _, _ = four.forward_backward([(ids[i : i + 1], labels[i : i + 1]) for i in range(4)], 0)

    assert abs(loss1 - loss4) / abs(loss1) < RTOL
    for p1, p4 in zip(one.lora.parameters(), four.lora.parameters(), strict=True):
        assert rel_err(p4.grad, p1.grad) < RTOL


@pytest.mark.parametrize(
    "variant",
    ["llama-attn-bias", "qwen3-qknorm-tied", "gemma2-softcap-window", "phi3-partial-longrope"],
)
def test_a_block_on_its_rows_flattened_equals_it_on_batched_rows_bit_for_bit(variant, tmp_path):
    """models.block_forward runs the family's block on (B·T, C) rows (fewer operator calls);
    the same block on (B, T, C) gives the same output and gradients, bit for bit, in bf16 and
    with LoRA dropout."""
    dtype = torch.bfloat16
    source = DictBlockSource.from_hf(make_model(tmp_path / "model", variant), dtype)
    args, w = source.args, source.block(1)
    lora = lora_with_random_b(args, dataclasses.replace(SPEC, dropout=0.2))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 20, args.hidden_size, generator=g).to(dtype)
    grad_out = torch.randn(2, 20, args.hidden_size, generator=g).to(dtype)
    cos, sin = rope.rope_cos_sin(args, 20, torch.device("cpu"), dtype)
    results = []
    for flat in (True, False):
        xg = x.clone().requires_grad_(True)
        ctx = lora.context(1, dtype)
        ctx.generator = torch.Generator().manual_seed(5)  # the same dropout masks both times
        if flat:
            y = models.block_forward(xg, w, args, cos, sin, ctx, layer=1)
        else:
            y = models.family(args).block_forward(xg, w, args, 1, cos, sin, ctx, None)
        assert y.shape == x.shape
        y.backward(grad_out)
        params = [p for ab in lora.blocks[1].values() for p in ab]
        results.append([y.detach(), xg.grad] + [p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["llama-gqa-rope3-tied", "phi3-partial-longrope"])
def test_a_power_of_two_scale_folded_into_b_is_bitwise_peft_s_order(variant, dtype, tmp_path):
    """LoraWeights.context folds alpha/rank = 2 into B; the loss and every gradient equal the
    unfolded (PEFT's: product, then scale, then add) bit for bit, over micro-batches and with
    LoRA dropout."""
    source = DictBlockSource.from_hf(make_model(tmp_path / "model", variant), dtype)
    spec = dataclasses.replace(SPEC, dropout=0.1)
    assert folds_scale(spec.scale, dtype) and not folds_scale(0.75, dtype)
    ids, labels = batch(4, 20, seed=3)
    results = []
    for fold in (True, False):
        lora = lora_with_random_b(source.args, spec)
        engine = StreamedEngine(source, lora, dtype=dtype)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(lora_module, "folds_scale", lambda scale, dtype, fold=fold: fold)
            loss, _, _ = engine.forward_backward([(ids[:2], labels[:2]), (ids[2:], labels[2:])], 0)
        results.append((loss, [p.grad for p in lora.parameters()]))
    (loss_folded, folded), (loss_peft, peft) = results
    assert loss_folded == loss_peft
    assert all(torch.equal(a, b) for a, b in zip(folded, peft, strict=True))


@pytest.mark.parametrize("variant", ["qwen2-bias", *FAMILY_VARIANTS])
def test_three_optimizer_steps_reproduce_the_reference_losses_and_parameters(variant, tmp_path):
    model_dir = make_model(tmp_path / "model", variant)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args)
    ref = peft_reference(model_dir, lora, tmp_path)
    ref_params = peft_params(ref)
    # the same parameter order as ours, so AdamW sees the same list
    ref_opt = torch.optim.AdamW(
        [ref_params[k] for k in lora.peft_state_dict()], lr=0.0, weight_decay=0.01
    )
    engine = StreamedEngine(source, lora, weight_decay=0.01, grad_clip=0.5)
    # AdamW moves an element by about lr (1e-2 here) whatever its gradient's size, so a wrong
    # gradient shows as ~1e-2. Near g = 0 its update lr·m/(√v + eps) has slope lr/eps, times
    # the fp32 rounding of the gradient (up to ~1e-8 here: it depends on the summation order,
    # two micro-batches vs one batch and the CPU's BLAS kernels). At the default eps (1e-8) that
    # is up to 1e6 × 1e-8: 1.5e-5 was seen on one element with AVX2 kernels. eps 1e-4 in both
    # optimizers makes it 100 × 1e-8 = 1e-6, below the 1e-5 allowed.
    for opt in (engine.optimizer, ref_opt):
        opt.param_groups[0]["eps"] = 1e-4
    before = lora.peft_state_dict()
    ours, theirs = [], []
    for step in range(3):
        lr = lr_at(step, lr=1e-2, warmup_steps=1, total_steps=3)
        # the families' T exceeds their windows and Phi-3's original length (long RoPE factors)
        ids, labels = batch(4, 16 if variant == "qwen2-bias" else 24, seed=10 + step)
        stats = engine.train_step([(ids[:2], labels[:2]), (ids[2:], labels[2:])], lr)
        ours.append(stats.loss)

        loss = reference_loss(ref, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_opt.param_groups[0]["params"], 0.5)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        ref_opt.zero_grad()
        theirs.append(loss.item())
    assert ours[0] != ours[2]  # the adapter moved
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) / abs(b) < RTOL, (ours, theirs)
    # the third update is seen only in the parameters: compare them all after it
    after = lora.peft_state_dict()
    for key, p in after.items():
        assert rel_err(p, ref_params[key]) < RTOL, key  # per tensor, as every check here
        # and element by element (see eps above)
        torch.testing.assert_close(p, ref_params[key].detach(), rtol=RTOL, atol=1e-5)
    assert not all(torch.equal(after[k], before[k]) for k in before)  # the parameters moved
    # round trip: the trained adapter, saved and loaded by PEFT, gives the engine's logits
    lora.save(tmp_path / "trained")
    loaded = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "trained").eval()
    ids, _ = batch(2, 24, seed=99)
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits.float()
    assert rel_err(engine.logits(ids), theirs) < RTOL


def test_recompute_with_dropout_draws_the_forwards_masks(tmp_path):
    """With LoRA dropout, the streamed gradients equal one autograd pass over the same masks."""
    model_dir = make_model(tmp_path / "model", "llama-mha")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.3)
    streamed = LoraWeights(source.args, spec, seed=2)
    with torch.no_grad():
        for block in streamed.blocks:
            for _, B in block.values():
                B.normal_(0, 0.1)
    plain = LoraWeights(source.args, spec, seed=2)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), streamed.parameters(), strict=True):
            p.copy_(q)
    ids, labels = batch(2, 16, seed=5)
    engine = StreamedEngine(source, streamed, seed=7)
    loss, _, _ = engine.forward_backward([(ids[:1], labels[:1]), (ids[1:], labels[1:])], step=4)

    # the same model as one autograd graph, with the engine's per-(step, block, micro-batch) masks
    g = source.globals()
    cos, sin = rope.rope_cos_sin(source.args, 16, torch.device("cpu"), torch.float32)
    ref = engine_ref = StreamedEngine(source, plain, seed=7)
    total = 0.0
    n = int((labels != -100).sum())
    for m in range(2):
        h = layers.embed(ids[m : m + 1], g)
        for i in range(source.args.num_layers):
            ctx = plain.context(i, torch.float32)
            ctx.generator = engine_ref._generator(4, i, m)
            h = layers.block_forward(h, source.block(i), source.args, cos, sin, ctx)
        part = layers.loss_sum(h, labels[m : m + 1], g, source.args) / n
        part.backward()
        total += part.item()
    assert ref is engine_ref
    assert abs(loss - total) / total < RTOL
    for p, q in zip(streamed.parameters(), plain.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < RTOL
    # and dropout really dropped something: without it the loss differs
    no_drop = StreamedEngine(source, LoraWeights(source.args, LoraSpec(4, 8.0, 0.0), seed=2))
    with torch.no_grad():
        for p, q in zip(no_drop.lora.parameters(), plain.parameters(), strict=True):
            p.copy_(q)
    assert abs(no_drop.forward_backward([(ids, labels)], 4)[0] - loss) > 1e-6


@pytest.mark.parametrize("variant", ["llama-gqa-rope3-tied", *FAMILY_VARIANTS])
def test_logits_match_transformers_and_peft(variant, tmp_path):
    model_dir = make_model(tmp_path / "model", variant)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args)
    ids, _ = batch(2, 30)
    ours = StreamedEngine(source, lora).logits(ids)
    with torch.no_grad():
        theirs = peft_reference(model_dir, lora, tmp_path)(input_ids=ids).logits.float()
    assert rel_err(ours, theirs) < RTOL


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_minimum_at_total_steps():
    def at(step, warmup=4):
        return lr_at(step, lr=2.0, warmup_steps=warmup, total_steps=14, min_lr_ratio=0.1)

    assert [at(s) for s in range(4)] == [0.5, 1.0, 1.5, 2.0]
    assert at(4) == 2.0  # the cosine starts at the peak
    assert math.isclose(at(9), 2.0 * (0.1 + 0.9 * 0.5))  # halfway: the mean of peak and floor
    assert math.isclose(at(14), 0.2) and math.isclose(at(30), 0.2)  # the floor, then held
    assert at(0, warmup=0) == 2.0


ROPE_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "arch, changes, field",
    [
        ("LlamaForCausalLM", dict(rope_parameters=None, rope_theta=1e4, rope_scaling=ROPE_YARN),
         "rope_scaling type 'yarn'"),
        ("LlamaForCausalLM", dict(rope_parameters={**ROPE_YARN, "rope_theta": 1e4}),
         "rope_parameters type 'yarn'"),
        ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("LlamaForCausalLM", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True), "use_sliding_window=true"),
    ],
)  # fmt: skip
def test_unsupported_config_fields_are_refused_by_name(tmp_path, arch, changes, field):
    model_dir = write_config(tmp_path / "model", arch, **changes)
    with pytest.raises(ModelError) as e:
        read_model_args(model_dir)
    assert f"{model_dir / 'config.json'}: {field}" in str(e.value)


def test_a_block_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha", with_tokenizer=False)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:, :32].contiguous()  # (64, 32): config.json implies (64, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    args = read_model_args(model_dir)
    ckpt = SafetensorsCheckpoint(model_dir)
    message = f"{name} has shape (64, 32), config.json implies (64, 64)"
    with pytest.raises(ModelError, match=re.escape(message)):
        ckpt.check(args)  # headers only, before any weight is read
    with pytest.raises(ModelError, match=re.escape(message)):
        read_block(ckpt, args, 1, torch.float32)
    assert read_block(ckpt, args, 0, torch.float32)  # the other blocks read as before
