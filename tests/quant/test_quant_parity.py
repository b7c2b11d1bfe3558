"""A quantized base (--base-quant) computes exactly what transformers computes with every linear
projection weight replaced by its quantize→dequantize round trip (fp32, CPU, 1e-5): `appliance
eval`, and the streamed step's loss and LoRA gradients against one full-model autograd step.
And QLoRA learns: a tiny fine-tune on an NF4 base lowers the held-out loss nearly as much as on
the bf16 base, and its adapter loads in PEFT on the unquantized base.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import PeftModel

from appliance import quant
from appliance.actors.weight_store import local_source
from appliance.adapter.evaluate import evaluate
from appliance.engine.step import StreamedEngine
from appliance.models.lora import LoraSpec, LoraWeights
from tests.adapter.test_evaluate import reference, write_jsonl
from tests.engine.test_engine_parity import (
    assert_two_micro_batches_match,
    peft_reference,
    reference_loss,
)
from tests.helpers_model import batch, load_hf, lora_with_random_b, make_model, rel_err
from tests.helpers_tokenizer import sentences

RTOL = 1e-5


def round_tripped(model_dir, kind: str, out):
    """A copy of the HF model whose blocks' linear weights are their `kind` round trip."""
    model = load_hf(model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            short = name.split(".", 3)[-1]
            if name.startswith("model.layers.") and quant.is_linear_weight(short):
                p.copy_(quant.round_trip(p, kind))
    model.save_pretrained(out)
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_eval_with_a_quantized_base_equals_transformers_on_round_tripped_weights(kind, tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied")
    ref_dir = round_tripped(model_dir, kind, tmp_path / "ref")
    texts = sentences(12, seed=3, min_words=2, max_words=16)
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])

    ours = evaluate(model_dir, data, seq_len=12, base_quant=kind)
    loss, n = reference(load_hf(ref_dir), ref_dir / "tokenizer.json", texts, 12)
    assert ours["tokens"] == n
    assert abs(ours["loss"] - loss) / loss < RTOL
    # the losses of a random model hardly move; its logits show the round trip is not a no-op
    ids, _ = batch(2, 12, seed=1)
    with torch.no_grad():
        rt_logits, plain_logits = load_hf(ref_dir)(ids).logits, load_hf(model_dir)(ids).logits
    engine = StreamedEngine(local_source(model_dir, "float32", kind), None)
    logits = engine.logits(ids)
    assert rel_err(logits, rt_logits) < RTOL
    assert rel_err(logits, plain_logits) > 100 * RTOL


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_streamed_step_on_a_quantized_base_equals_autograd_on_round_tripped_weights(kind, tmp_path):
    model_dir = make_model(tmp_path / "model", "qwen2-bias")  # biases stay unquantized
    ref_dir = round_tripped(model_dir, kind, tmp_path / "ref")
    source = local_source(model_dir, "float32", kind)  # the WeightStore's flat layout
    lora = lora_with_random_b(source.args)
    ref = peft_reference(ref_dir, lora, tmp_path)
    assert_two_micro_batches_match(source, lora, ref, reference_loss, seq_len=20)


def _train(source, steps: int, seed: int = 0) -> tuple[LoraWeights, list[float]]:
    """A short LoRA fine-tune on a fixed pattern; returns the adapter and the held-out losses
    before and after."""
    spec = LoraSpec(rank=16, alpha=32.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    lora = LoraWeights(source.args, spec, seed=seed)
    engine = StreamedEngine(source, lora, grad_clip=1.0)
    (ids, labels), held_out = _pattern(8, seed=10), _pattern(4, seed=99)
    before = _loss(engine, held_out)
    for _ in range(steps):
        engine.train_step([(ids[:4], labels[:4]), (ids[4:], labels[4:])], lr=1e-2)
    return lora, [before, _loss(engine, held_out)]


def _pattern(rows: int, seed: int, T: int = 16):
    """Rows of random tokens, each labelled with a fixed function of itself (a permutation of
    the vocabulary): held-out rows share the rule, not the text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (rows, T), generator=g)
    rule = 3 + (torch.arange(64) * 7) % 61
    return ids, rule[ids]


def _loss(engine: StreamedEngine, mb) -> float:
    total, n = engine.eval_loss([mb])
    return total / n


def test_qlora_on_nf4_learns_nearly_as_much_as_on_bf16_and_its_adapter_loads_in_peft(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied", num_hidden_layers=1)
    _, bf16 = _train(local_source(model_dir, "bfloat16"), steps=40)  # bf16 store, fp32 compute
    lora, nf4 = _train(local_source(model_dir, "bfloat16", "nf4"), steps=40)
    gain_bf16, gain_nf4 = bf16[0] - bf16[1], nf4[0] - nf4[1]
    assert gain_bf16 > 0.1 * bf16[0]  # the run learned (4.15 → 3.56 when written)
    assert gain_nf4 >= 0.8 * gain_bf16, (bf16, nf4)

    lora.save(tmp_path / "adapter")  # PEFT format; loads on the unquantized base as QLoRA's do
    peft = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter")
    ids, labels = _pattern(4, seed=99)
    with torch.no_grad():
        logits = peft(input_ids=ids).logits
    peft_loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1)))
    assert peft_loss < nf4[0] - 0.8 * gain_nf4  # on the unquantized base it keeps most of the gain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_blocks_stream_to_the_gpu_and_equal_the_cpu(kind, tmp_path):
    """On CUDA the quantized bytes are what is uploaded, and the step equals the CPU's (fp32,
    TF32 off; not run where no GPU is lent)."""
    model_dir = make_model(tmp_path / "model", "qwen2-bias")
    source = local_source(model_dir, "float32", kind)
    ids, labels = batch(4, 20, seed=2)
    mbs = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        cpu = lora_with_random_b(source.args)
        gpu = lora_with_random_b(source.args, device="cuda")
        loss_cpu, _, _ = StreamedEngine(source, cpu, grad_clip=None).forward_backward(mbs, 0)
        with StreamedEngine(source, gpu, device="cuda", grad_clip=None) as engine:
            loss_gpu, _, _ = engine.forward_backward(mbs, 0)
            h2d = engine.weights.take_timings()["h2d_bytes"]
            per_block = engine.weights.block_bytes()
    finally:
        torch.set_float32_matmul_precision(precision)
    assert abs(loss_gpu - loss_cpu) / abs(loss_cpu) < RTOL
    for a, b in zip(gpu.parameters(), cpu.parameters(), strict=True):
        assert rel_err(a.grad, b.grad) < 1e-4
    assert h2d == source.num_blocks * per_block  # resident here: each block uploaded once
    assert per_block == sum(
        quant.quantized_nbytes(tuple(t.shape), getattr(t, "kind", "none"), torch.float32)
        for t in source.block(0).values()
    )
