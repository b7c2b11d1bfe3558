"""The LM head and loss, made chunk by chunk over the sequence (model.head_chunks), equal the
whole-sequence computation; and chunking is what keeps a 128k vocabulary from forcing the saved
activations off the GPU (planner.plan_memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.engine import memory as planner
from appliance.engine.memory import plan_memory
from appliance.models import block_param_count, layers
from appliance.models.presets import _llama

ARGS = _llama(97, 32, 64, 2, 4, 2)


def head_inputs(B: int = 2, T: int = 13):
    g = torch.Generator().manual_seed(0)
    glob = {
        "model.embed_tokens.weight": torch.randn(ARGS.vocab_size, ARGS.hidden_size, generator=g),
        "model.norm.weight": 1 + 0.1 * torch.randn(ARGS.hidden_size, generator=g),
    }
    h = torch.randn(B, T, ARGS.hidden_size, generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (B, T), generator=g)
    labels[0, :4] = -100
    return h, labels, glob


def whole(h, labels, glob, denom):
    """The head in one piece, differentiated by autograd: the reference."""
    h = h.detach().requires_grad_(True)
    lg = layers.logits(h, glob, ARGS)
    loss = F.cross_entropy(
        lg.view(-1, lg.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    (loss / denom).backward()
    return loss / denom, h.grad


@pytest.mark.parametrize("values", [1, 97 * 2 * 3, 97 * 2 * 5, 2**24])  # 1 position ... all
def test_chunked_head_equals_the_whole_sequence(monkeypatch, values):
    monkeypatch.setattr(layers, "HEAD_CHUNK_VALUES", values)
    h, labels, glob = head_inputs()
    chunks = layers.head_chunks(h, ARGS.vocab_size)
    assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(h.shape[1]))
    if values < 2**24:
        assert len(chunks) > 1
    ref_loss, ref_grad = whole(h, labels, glob, denom=7)
    loss, grad = layers.loss_and_grad(h, labels, glob, ARGS, denom=7)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)  # summed in another order
    # per position the same arithmetic, but the head's matmuls over fewer rows may block their
    # sums differently
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(layers.loss_sum(h, labels, glob, ARGS) / 7, ref_loss, rtol=1e-6)


def test_loss_scale_scales_the_gradient_not_the_loss():
    h, labels, glob = head_inputs()
    loss, grad = layers.loss_and_grad(h, labels, glob, ARGS, denom=3)
    loss_s, grad_s = layers.loss_and_grad(h, labels, glob, ARGS, denom=3, scale=1024.0)
    assert loss_s == loss
    assert torch.equal(grad_s, grad * 1024)  # a power of two: exact


def test_a_128k_vocabulary_does_not_force_activation_offload(monkeypatch):
    """Llama 3 8B's shape, micro-batches of 4 × 2048, 24 GiB: whole-sequence fp32 logits (three
    copies: 12.6 GB) would push the saved inputs to the host; one chunk of them does not."""
    args = _llama(128256, 4096, 14336, 32, 32, 8)

    def plan():
        return plan_memory(
            args, dtype_bytes=2, budget=24 * 2**30, tokens=4 * 8192, biggest=8192,
            block_bytes=block_param_count(args) * 2, globals_bytes=2 * 128256 * 4096 * 2,
            lora_params=0,
        )  # fmt: skip

    assert not plan().offload_activations
    monkeypatch.setattr(planner, "HEAD_CHUNK_VALUES", 8192 * 128256)  # the whole micro-batch
    assert plan().offload_activations
