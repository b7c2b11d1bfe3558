"""What one optimizer step of the engine reports: its target tokens, and its own timings only.

The parity of the step's numbers with transformers is tests/engine/test_engine_parity.py; here, the
bookkeeping around them (CPU). Timings are checked against a clock that ticks by exactly 1 s, so
the assertions count recorded waits instead of comparing measured seconds.
"""

from __future__ import annotations

import itertools

import torch

from appliance.engine import device_weights as streaming
from appliance.engine.batches import count_targets
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from tests.helpers_model import batch, lora_with_random_b, make_model


def uneven_micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three micro-batches whose rows carry different numbers of targets, one row none at all."""
    ids, labels = batch(5, 12, seed=3)
    labels[1, 5:9] = -100  # a masked span in the middle (a user turn, a document boundary)
    labels[3] = -100  # a row of prompt only
    return [(ids[:2], labels[:2]), (ids[2:3], labels[2:3]), (ids[3:], labels[3:])]


def test_target_tokens_are_the_labels_counted_on_the_host_and_divide_the_loss(tmp_path):
    source = DictBlockSource.from_hf(
        make_model(tmp_path / "model", "llama-gqa-rope3-tied"), torch.float32
    )
    mbs = uneven_micro_batches()
    expected = sum(int((lab != -100).sum()) for _, lab in mbs)
    assert expected == 5 * 12 - 5 * 3 - 4 - (12 - 3)  # prompts, the span, the all-prompt row
    assert count_targets(mbs) == expected

    engine = StreamedEngine(source, lora_with_random_b(source.args))
    nll, n_eval = engine.eval_loss(mbs)  # summed NLL over the global batch, before any update
    loss, n_step, _ = engine.forward_backward(mbs, step=0)
    assert n_eval == n_step == expected
    # the loss is the global batch's mean over its target tokens, not a mean of per-batch means
    assert abs(loss - nll / expected) <= 1e-6 * abs(loss)
    engine.optimizer.zero_grad(set_to_none=True)
    assert engine.train_step(mbs, lr=1e-3).target_tokens == expected


def test_an_eval_between_two_steps_is_not_counted_in_the_next_steps_timings(tmp_path, monkeypatch):
    """On a CPU the engine records how long compute waited for each block's weights (one wait per
    block per pass: forward, then backward), timed on the host clock. An eval and a logits call
    between two steps fetch blocks too; the second step must report only its own waits."""
    ticks = itertools.count()
    monkeypatch.setattr(streaming, "_clock", lambda: float(next(ticks)))  # each wait: 1 s
    source = DictBlockSource.from_hf(make_model(tmp_path / "model", "llama-mha"), torch.float32)
    L = source.args.num_layers
    mbs = uneven_micro_batches()
    engine = StreamedEngine(source, lora_with_random_b(source.args))

    first = engine.train_step(mbs, lr=1e-3)
    assert first.phase_seconds["h2d_stall"] == 2 * L
    engine.eval_loss(mbs)
    engine.logits(mbs[0][0])
    second = engine.train_step(mbs, lr=1e-3)
    assert second.phase_seconds["h2d_stall"] == 2 * L  # not 4·L: the eval's and logits' waits
    assert (second.h2d_bytes, second.h2d_seconds) == (first.h2d_bytes, first.h2d_seconds) == (0, 0)
    # and a step that follows a step directly is the same
    assert engine.train_step(mbs, lr=1e-3).phase_seconds["h2d_stall"] == 2 * L
