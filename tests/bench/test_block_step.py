"""benchmarks/block_step.py, the measurement that chooses between the eager block (fused
primitives) and torch.compile of it on a GPU: on a CPU, its compiled block equals the eager one
(output and LoRA gradients, fp32), dropout masks included, and its rows carry what the table
prints."""

from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks.block_step import block_args, time_block


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="torch.compile on a CPU needs a C++ compiler",
)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_compiled_block_equals_the_eager_block(dropout):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = block_args("llama", hidden=64, heads=4, kv_heads=2)
        row = time_block(args, dropout, batch=1, seq=16, reps=1, compile_block=True)
    finally:
        torch.set_num_threads(threads)
    assert row["impl"] == "compiled" and row["compile_seconds"] > 0
    # a different graph, the same numbers: fp32 rounding apart, not a different dropout mask
    assert row["max_abs_diff_output"] < 1e-5
    assert row["max_abs_diff_lora_grad"] < 1e-5
    assert row["forward_ms"] > 0 and row["recompute_backward_ms"] > 0
    # the block compiles whole, with dropout too: its masks are drawn before the compiled block
    assert row["graph_breaks"] == 0


def test_the_eager_row_has_no_compile_figures():
    row = time_block(block_args("qwen3", 64, 4, 2), 0.0, batch=1, seq=16, reps=1)
    assert row["impl"] == "eager" and "compile_seconds" not in row
    # the host's operator calls for one micro-batch: the recompute and its backward outnumber
    # the no-grad forward
    assert 0 < row["forward_ops"] < row["recompute_backward_ops"]
