"""The streamed step equals an ordinary full-model autograd step of transformers + peft (fp32, CPU).

Tolerance: 1e-5 relative error (DESIGN.md, "Numerics that must hold").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel

from appliance.blocks import DictBlockSource
from appliance.engine import StreamedEngine, lr_at
from appliance.lora import LoraSpec, LoraWeights, peft_key
from tests.helpers_model import VARIANTS, VOCAB, load_hf, make_model

RTOL = 1e-5
SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_lora(args, seed=1) -> LoraWeights:
    """LoRA with non-zero B, so every A and B gets a non-trivial gradient."""
    lora = LoraWeights(args, SPEC, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for block in lora.blocks:
            for _, B in block.values():
                B.copy_(torch.randn(B.shape, generator=g) * 0.1)
    return lora


def batch(n_rows: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n_rows, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :3] = -100  # some positions carry no loss, as prompts and padding do
    return ids[:, :-1].contiguous(), labels


def peft_reference(model_dir, lora: LoraWeights, tmp_path) -> PeftModel:
    lora.save(tmp_path / "adapter")
    model = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter", is_trainable=True)
    return model


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


def peft_grads(model) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_" in n}


@pytest.fixture(params=list(VARIANTS))
def variant_dir(request, tmp_path):
    return make_model(tmp_path / "model", request.param, shards=request.param == "mistral")


def test_loss_and_every_lora_gradient_match_transformers_with_peft(variant_dir, tmp_path):
    source = DictBlockSource.from_hf(variant_dir, torch.float32)
    lora = random_lora(source.args)
    ref = peft_reference(variant_dir, lora, tmp_path)
    ids, labels = batch(4, 24)

    engine = StreamedEngine(source, lora, grad_clip=None)
    loss, n_target, _ = engine.forward_backward([(ids, labels)], step=0)

    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    assert n_target == int((labels != -100).sum())
    assert abs(loss - float(ref_loss)) / abs(float(ref_loss)) < RTOL
    ref_grads = peft_grads(ref)
    checked = 0
    for i, block in enumerate(lora.blocks):
        for module, (A, B) in block.items():
            for which, p in (("A", A), ("B", B)):
                key = peft_key(i, module, which)
                assert rel_err(p.grad, ref_grads[key]) < RTOL, key
                checked += 1
    assert checked == len(ref_grads) == source.args.num_layers * 7 * 2


def test_four_micro_batches_equal_one_batch_of_four(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    ids, labels = batch(4, 20, seed=3)
    labels[2, :] = -100  # uneven target counts per micro-batch: normalisation must be global

    one = StreamedEngine(source, random_lora(source.args))
    four = StreamedEngine(source, random_lora(source.args))
    loss1, _, _ = one.forward_backward([(ids, labels)], step=0)
    loss4, _, _ = four.forward_backward([(ids[i : i + 1], labels[i : i + 1]) for i in range(4)], 0)

    assert abs(loss1 - loss4) / abs(loss1) < RTOL
    for p1, p4 in zip(one.lora.parameters(), four.lora.parameters(), strict=True):
        assert rel_err(p4.grad, p1.grad) < RTOL


def test_three_optimizer_steps_reproduce_the_reference_losses(tmp_path):
    model_dir = make_model(tmp_path / "model", "qwen2-bias")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = random_lora(source.args)
    ref = peft_reference(model_dir, lora, tmp_path)
    ref_params = dict(ref.named_parameters())
    ref_opt = torch.optim.AdamW(
        [
            ref_params[n]
            for n in (
                k.replace("lora_A.weight", "lora_A.default.weight").replace(
                    "lora_B.weight", "lora_B.default.weight"
                )
                for k in lora.peft_state_dict()
            )
        ],
        lr=0.0,
        weight_decay=0.01,
    )
    engine = StreamedEngine(source, lora, weight_decay=0.01, grad_clip=0.5)
    ours, theirs = [], []
    for step in range(3):
        lr = lr_at(step, lr=1e-2, warmup_steps=1, total_steps=3)
        ids, labels = batch(4, 16, seed=10 + step)
        stats = engine.train_step([(ids[:2], labels[:2]), (ids[2:], labels[2:])], lr)
        ours.append(stats.loss)

        loss = reference_loss(ref, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_opt.param_groups[0]["params"], 0.5)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        ref_opt.zero_grad()
        theirs.append(float(loss))
    assert ours[0] != ours[2]  # the adapter moved
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) / abs(b) < RTOL, (ours, theirs)


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
    from appliance import model as M

    g = source.globals()
    cos, sin = M.rope_cos_sin(source.args, 16, torch.device("cpu"), torch.float32)
    ref = engine_ref = StreamedEngine(source, plain, seed=7)
    total = 0.0
    n = int((labels != -100).sum())
    for m in range(2):
        h = M.embed(ids[m : m + 1], g)
        for i in range(source.args.num_layers):
            ctx = plain.context(i, torch.float32)
            ctx.generator = engine_ref._generator(4, i, m)
            h = M.block_forward(h, source.block(i), source.args, cos, sin, ctx)
        part = M.loss_sum(h, labels[m : m + 1], g, source.args) / n
        part.backward()
        total += float(part)
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


def test_logits_match_transformers_and_peft(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = random_lora(source.args)
    ids, _ = batch(2, 30)
    ours = StreamedEngine(source, lora).logits(ids)
    with torch.no_grad():
        theirs = peft_reference(model_dir, lora, tmp_path)(input_ids=ids).logits.float()
    assert rel_err(ours, theirs) < RTOL
