"""plan/shape.py: the micro-batch's shape for a GPU (more rows, fewer micro-batches, the same
tokens a step), where `--micro-batch-size` was left at train's default and memory allows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner

from appliance.cli.main import main
from appliance.config import build_config
from appliance.engine.memory import CUDA_MARGIN_BYTES
from appliance.models.presets import PRESETS
from appliance.plan.auto import gpu_micro_batch_shape
from appliance.plan.estimate import PlanInput, evaluate
from appliance.plan.report import make_plan
from appliance.plan.shape import GPU_MICRO_BATCH_TOKENS, gpu_micro_batch, shape_note
from appliance.run.driver import resolve_micro_batches
from appliance.run.progress import Progress
from appliance.run.resume import OutputDecision
from appliance.run.state import Inputs

GiB = 2**30
MODEL = {"model": "m", "data": "d.jsonl", "output": "out"}  # a run's required flags


def train_default(preset: str, gpu: str, **kw) -> PlanInput:
    """train's default shape (4 rows × 256 tokens, 4 micro-batches) on `gpu`."""
    return PlanInput(PRESETS[preset].args, preset, gpu, **kw)


def test_on_an_a10_and_an_h100_7b_takes_4096_tokens_a_micro_batch_at_the_same_step():
    for gpu in ("a10", "h100"):
        p = train_default("7b", gpu)
        assert (p.micro_batch_size, p.seq_len, p.micro_batches_per_step) == (4, 256, 4)
        rows, m, why = gpu_micro_batch(p, 4)
        assert (rows, m) == (16, 1) and rows * 256 == GPU_MICRO_BATCH_TOKENS
        assert why.startswith("≥ 4096 tokens a micro-batch")
        before, after = evaluate(p, 4), evaluate(replace(p, micro_batch_size=rows), m)
        assert after["tokens_per_step"] == before["tokens_per_step"] == 4096
        assert after["resident_blocks"] == before["resident_blocks"]


def test_it_stops_before_a_block_leaves_residency():
    """70B NF4 on an A10: 8 rows a micro-batch would cost a resident block (the working set of
    one micro-batch through a block doubles), so the shape stays."""
    p = train_default("70b", "a10", base_quant="nf4")
    assert gpu_micro_batch(p, 4) == (4, 4, "8 rows a micro-batch would keep fewer blocks resident")
    two = evaluate(replace(p, micro_batch_size=8), 2)
    assert two["resident_blocks"] < evaluate(p, 4)["resident_blocks"]


def test_under_tiny_budgets_it_merges_as_far_as_the_plan_stays_as_good():
    def budget(gib: float) -> PlanInput:
        return train_default("7b", "a10", gpu_memory_budget=int(gib * GiB) + CUDA_MARGIN_BYTES)

    # 2.5 GiB: train's shape fits with every block streaming; 8 rows would not fit
    assert evaluate(budget(2.5), 4)["gpu_fits"]
    assert gpu_micro_batch(budget(2.5), 4) == (4, 4, "8 rows a micro-batch would not fit the GPU")
    # 3.5 GiB: 8 rows keep train's 2 resident blocks, 16 would keep none: 8 rows, 2 a step
    p = budget(3.5)
    assert [evaluate(replace(p, micro_batch_size=r), 16 // r)["resident_blocks"]
            for r in (4, 8, 16)] == [2, 2, 0]  # fmt: skip
    rows, m, why = gpu_micro_batch(p, 4)
    assert (rows, m, why) == (8, 2, "16 rows a micro-batch would keep fewer blocks resident")
    # a budget the step does not fit at all: nothing to merge
    assert gpu_micro_batch(budget(0.0625), 4) == (4, 4, "the step does not fit the GPU as it is")


def test_a_micro_batch_already_large_enough_is_kept():
    p = train_default("7b", "h100", seq_len=2048, micro_batch_size=2)
    assert gpu_micro_batch(p, 8) == (2, 8, "2 × 2048 tokens is already ≥ 4096")


def test_plan_says_the_shape_and_an_explicit_micro_batch_size_wins():
    out = CliRunner().invoke(main, ["plan", "--preset", "7b", "--gpu", "a10"])
    assert "--micro-batch-size 16 (train's default 4, for the GPU: ≥ 4096 tokens" in out.output
    assert "step: 1 × 16 × 256 = 4096 tokens per GPU" in out.output
    given = CliRunner().invoke(main, ["plan", "--preset", "7b", "--gpu", "a10",
                                      "--micro-batch-size", "4"])  # fmt: skip
    assert "--micro-batch-size 4 (given)" in given.output
    assert "step: 4 × 4 × 256 = 4096 tokens per GPU" in given.output
    r = make_plan(train_default("7b", "a10", train_defaults=("micro_batch_size",)))
    assert (r["micro_batch_size"], r["micro_batches_per_step"]) == (16, 1)


def test_train_knows_which_keys_were_given_and_a_resume_keeps_knowing():
    assert "micro_batch_size" not in build_config(flag_values=MODEL).given
    assert "micro_batch_size" in build_config().given  # the demo's shape is the demo's
    cfg = build_config(flag_values={**MODEL, "micro_batch_size": "4"})
    assert "micro_batch_size" in cfg.given
    recorded = build_config(
        run_values={**MODEL, "micro_batch_size": 16, "micro_batches_per_step": 1}
    )
    assert {"micro_batch_size", "micro_batches_per_step"} <= recorded.given  # kept on resume
    assert "micro_batch_size" in OutputDecision(resume=True).applied_to(cfg).given


def test_on_a_cpu_train_keeps_its_default_shape(tmp_path: Path):
    cfg = build_config(flag_values=MODEL)
    assert "micro_batch_size" not in cfg.given
    inp = Inputs(cfg, tmp_path, tmp_path, eos_id=0, pad_id=None, device="cpu", dtype="float32")
    before = (cfg.micro_batch_size, cfg.micro_batches_per_step)
    resolve_micro_batches(inp, Progress("plain"))
    assert (cfg.micro_batch_size, cfg.micro_batches_per_step) == before


def test_train_s_gpu_path_takes_the_plan_s_shape_on_the_measured_gpu():
    measured = {  # what an A10 would measure if it matched the table
        "h2d_bytes_per_second": 25e9,
        "flops_per_second": 70e12,
        "memory_bytes": 23028 * 2**20,
        "name": "NVIDIA A10",
    }
    shape = dict(seq_len=256, micro_batch_size=4, lora_rank=16, dtype_bytes=2, budget=None,
                 lora_targets=tuple(PlanInput(PRESETS["7b"].args, "", "a10").lora_targets))  # fmt: skip
    rows, m, why = gpu_micro_batch_shape(PRESETS["7b"].args, measured, 4, **shape)
    assert (rows, m) == (16, 1)
    line = shape_note(rows, m, 256, why, (4, 4))
    assert line.startswith("micro-batch 16 × 256 tokens, 1 a step, for the GPU (was 4 × 256, 4")
    assert "the same 4096 tokens a step" in line and "--micro-batch-size N keeps yours" in line
