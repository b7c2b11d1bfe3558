"""`compile_blocks`: the engine's blocks through torch.compile (models.compiled_block_forward).

On a CPU Inductor generates C++ (the system compiler); the math must keep the eager block's
parity (1e-5 relative, fp32; the eager block is transformers + PEFT's, bit for bit), and be
compiled whole once per kind of layer, not once per layer or in pieces. Its speed is measured
on a GPU (benchmarks/gpu_proof.sh block).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from appliance import models
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from appliance.models import rope
from appliance.models.presets import PRESETS
from tests.engine.test_engine_parity import RTOL
from tests.helpers_model import SPEC, batch, lora_with_random_b, make_model, rel_err


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="torch.compile on a CPU needs a C++ compiler",
)
@pytest.mark.parametrize(
    "variant, dropout", [("llama-gqa-rope3-tied", 0.1), ("gemma2-softcap-window", 0.0)]
)
def test_compiled_blocks_equal_the_eager_ones_compiled_once_per_kind_of_layer(
    variant, dropout, tmp_path
):
    """A step of two micro-batches with compiled blocks gives the eager blocks' loss and LoRA
    gradients (which equal transformers + PEFT: test_engine_parity), with LoRA dropout too: its
    masks are drawn outside the compiled block, from the same generators, so they are the eager
    ones, and the block compiles whole (no graph breaks: the graphs are counted)."""
    model_dir = make_model(tmp_path / "model", variant)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    args = source.args
    spec = dataclasses.replace(SPEC, dropout=dropout)
    ids, labels = batch(4, 24)
    mbs = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        graphs = counters["stats"]["unique_graphs"]
        lora = lora_with_random_b(args, spec)
        engine = StreamedEngine(source, lora, grad_clip=None, compile_blocks=compiled)
        loss, _, _ = engine.forward_backward(mbs, step=0)
        results.append((torch.tensor(loss), [p.grad for p in lora.parameters()]))
        made = counters["stats"]["unique_graphs"] - graphs
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert rel_err(loss_c, loss_e) < RTOL
    assert all(rel_err(c, e) < RTOL for c, e in zip(grads_c, grads_e, strict=True))
    # one graph for the no-grad forward and one for the recompute (with its backward) per kind
    kinds = {args.window(i) for i in range(args.num_layers)}
    assert len(kinds) < args.num_layers or variant.startswith("llama")
    assert made == 2 * len(kinds)


def test_the_compiled_blocks_dropout_masks_are_the_eager_blocks(tmp_path):
    """dropout_masks draws, from one generator, exactly the masks the eager block's projections
    draw in turn: the same generator state after the block, and the same block output."""
    model_dir = make_model(tmp_path / "model", "phi3-partial-longrope")
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    args, w = source.args, source.block(0)
    lora = lora_with_random_b(args, dataclasses.replace(SPEC, dropout=0.3))
    x = torch.randn(2 * 20, args.hidden_size)
    cos, sin = rope.rope_cos_sin(args, 20, torch.device("cpu"), torch.float32)
    outputs = []
    for drawn_first in (False, True):
        ctx = lora.context(0, torch.float32)
        ctx.generator = torch.Generator().manual_seed(7)
        if drawn_first:
            ctx.masks = models.dropout_masks(x, args, ctx)
        with torch.no_grad():
            y = models.family(args).block_forward(x, w, args, 0, cos, sin, ctx, None)
        outputs.append((y, torch.rand(1, generator=ctx.generator)))
    (y_eager, next_eager), (y_drawn, next_drawn) = outputs
    assert torch.equal(y_drawn, y_eager) and torch.equal(next_drawn, next_eager)


def test_a_layer_is_compiled_as_the_first_layer_with_its_window(tmp_path):
    args = DictBlockSource.from_hf(
        make_model(tmp_path / "model", "gemma2-softcap-window"), torch.float32
    ).args
    windows = [args.window(i) for i in range(args.num_layers)]
    assert windows[0] != windows[1] and windows[2] == windows[0]  # sliding, full, sliding
    assert [models.first_layer_like(args, i) for i in range(3)] == [0, 1, 0]


def test_a_mixture_of_experts_runs_eager_under_compile_blocks_and_says_so(tmp_path):
    """--compile-blocks with a MoE model: its blocks run eager (the expert loop's data-dependent
    shapes would break Dynamo's graph at every expert), so the step equals the eager one bit for
    bit and nothing is compiled; train's notes say so (models.compile_blocks_note)."""
    model_dir = make_model(tmp_path / "model", "qwen3-moe", with_tokenizer=False)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    ids, labels = batch(2, 12)
    results = []
    for compiled in (False, True):
        graphs = counters["stats"]["unique_graphs"]
        lora = lora_with_random_b(source.args, SPEC)
        engine = StreamedEngine(source, lora, compile_blocks=compiled)
        loss, _, _ = engine.forward_backward([(ids, labels)], step=0)
        results.append((loss, [p.grad for p in lora.parameters()]))
        assert counters["stats"]["unique_graphs"] == graphs
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert loss_c == loss_e
    assert all(torch.equal(c, e) for c, e in zip(grads_c, grads_e, strict=True))
    assert models.compile_blocks_note(source.args).startswith(
        "--compile-blocks: the mixture-of-experts blocks run eager"
    )
    assert models.compile_blocks_note(PRESETS["qwen3-8b"].args) is None
