"""`compile_blocks`: the engine's blocks through torch.compile (models.compiled_block_forward).

On a CPU Inductor generates C++ (the system compiler); the math must keep the eager block's
parity with transformers + PEFT (1e-5 relative, fp32), and be compiled once per kind of layer,
not once per layer. Its speed is measured on a GPU (benchmarks/gpu_proof.sh block).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from appliance import models
from appliance.blocks import DictBlockSource
from appliance.engine import StreamedEngine
from tests.helpers_model import batch, lora_with_random_b, make_model, rel_err
from tests.test_engine_parity import (
    RTOL,
    assert_gradients_match,
    peft_reference,
    reference_loss,
)


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="torch.compile on a CPU needs a C++ compiler",
)
@pytest.mark.parametrize("variant", ["llama-gqa-rope3-tied", "gemma2-softcap-window"])
def test_compiled_blocks_match_transformers_with_peft_compiled_once_per_kind_of_layer(
    variant, tmp_path
):
    model_dir = make_model(tmp_path / "model", variant)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    args = source.args
    lora = lora_with_random_b(args)
    ref = peft_reference(model_dir, lora, tmp_path)
    ids, labels = batch(4, 24)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]

    engine = StreamedEngine(source, lora, grad_clip=None, compile_blocks=True)
    loss, _, _ = engine.forward_backward([(ids[:2], labels[:2]), (ids[2:], labels[2:])], step=0)

    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)
    # one graph for the no-grad forward and one for the recompute (with its backward) per kind
    kinds = {args.window(i) for i in range(args.num_layers)}
    assert len(kinds) < args.num_layers or variant.startswith("llama")
    assert counters["stats"]["unique_graphs"] - graphs == 2 * len(kinds)


def test_a_layer_is_compiled_as_the_first_layer_with_its_window(tmp_path):
    args = DictBlockSource.from_hf(
        make_model(tmp_path / "model", "gemma2-softcap-window"), torch.float32
    ).args
    windows = [args.window(i) for i in range(args.num_layers)]
    assert windows[0] != windows[1] and windows[2] == windows[0]  # sliding, full, sliding
    assert [models.first_layer_like(args, i) for i in range(3)] == [0, 1, 0]
