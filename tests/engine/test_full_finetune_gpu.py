"""The full fine-tune engine on CUDA: with blocks streaming under a budget, gradients copied
device→host on the side stream and AdamW on the host, three fp32 steps equal the CPU engine's
(which equals transformers + torch.optim.AdamW: tests/engine/test_full_finetune.py).

Skipped without a CUDA GPU (written without one: issue 46's session had none). TF32 off.
"""

from __future__ import annotations

import pytest
import torch

from appliance.engine.blocks import DictBlockSource
from appliance.engine.full import FullFinetuneEngine
from appliance.engine.memory import streaming_budget
from appliance.plan import full
from tests.helpers_model import batch, make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KW = dict(weight_decay=0.01, eps=1e-5, grad_clip=0.5)


@pytest.fixture(autouse=True)
def _highest_precision():
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def medium_model(tmp_path):
    """4 blocks of 3.2 M parameters (12.8 MB in fp32): big enough that a budget lands between
    residency counts (memory.streaming_budget's steps are a quarter block, 1 MiB at least)."""
    return make_model(
        tmp_path / "model", "llama-mha", hidden_size=512, intermediate_size=1408,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip


def micro_batches(seed: int):
    ids, labels = batch(4, 64, seed=seed)
    return [(ids[:2], labels[:2]), (ids[2:], labels[2:])]


def test_fp32_cuda_streamed_full_finetune_equals_the_cpu_engine(tmp_path):
    source = DictBlockSource.from_hf(medium_model(tmp_path), torch.float32)
    cpu = FullFinetuneEngine(source, **KW)
    budget = streaming_budget(cpu.args, **cpu.plan_inputs(micro_batches(0)))
    gpu = FullFinetuneEngine(source, device="cuda", gpu_memory_budget=budget, **KW)
    L = cpu.args.num_layers
    for step in range(3):
        a = cpu.train_step(micro_batches(step), 1e-3)
        b = gpu.train_step(micro_batches(step), 1e-3)
        assert abs(a.loss - b.loss) <= 1e-5 * abs(a.loss), (step, a.loss, b.loss)
        assert b.d2h_bytes == 4 * gpu.host.num_parameters()  # every gradient, once
        assert b.gpu_busy_seconds is not None and b.gpu_busy_seconds > 0
        resident = len(gpu.weights.resident)
        if step:  # every block copied again after its update (plan/full.py's count)
            expected = full.blocks_uploaded_per_step(L, resident) * gpu.weights.block_bytes()
            assert b.h2d_bytes == expected, (b.h2d_bytes, expected)
    assert 0 < resident < L, f"budget {budget} did not make blocks stream"
    ours, theirs = gpu.named_weights(), cpu.named_weights()
    for k, w in theirs.items():
        torch.testing.assert_close(ours[k], w, rtol=0, atol=1e-5, msg=k)
    gpu.close()


def test_bf16_cuda_full_finetune_learns_and_keeps_fp32_masters(tmp_path):
    source = DictBlockSource.from_hf(medium_model(tmp_path), torch.bfloat16)
    engine = FullFinetuneEngine(source, device="cuda", dtype=torch.bfloat16, **KW)
    mbs = micro_batches(0)
    losses = [engine.train_step(mbs, 1e-3).loss for _ in range(4)]
    assert losses[-1] < losses[0], losses  # the same batch, four steps: it learns
    weights = engine.named_weights()
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    master = engine.host.master["0"]
    assert all(m.dtype == torch.float32 for m in master.values())
    # the bf16 weights the forward reads are the fp32 masters rounded
    for k, m in master.items():
        assert torch.equal(engine.source.block(0)[k], m.to(torch.bfloat16)), k
    engine.close()
