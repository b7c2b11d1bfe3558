"""Full fine-tuning's host arithmetic (plan/full.py): bytes per parameter by part, the GPU's
gradient buffers as the engine allocates them, and `train` refusing, before it reads a weight, a
run whose masters and moments cannot fit this host."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from appliance.cli.main import main
from appliance.engine.blocks import DictBlockSource
from appliance.engine.full import FullFinetuneEngine
from appliance.hardware.measure import host_memory_available
from appliance.models import param_count
from appliance.models.presets import PRESETS
from appliance.plan import full
from tests.helpers_model import config_only_7b, make_model


def test_host_bytes_per_parameter_by_part():
    args = PRESETS["7b"].args
    n = param_count(args)
    bf16 = full.host_bytes(args, 2)
    assert bf16 == {"weights": 2 * n, "master": 4 * n, "moments": 8 * n, "grad_buffers": 4 * n,
                    "total": 18 * n}  # fmt: skip
    assert full.host_bytes(args, 4)["total"] == 16 * n  # fp32: the weights are the master
    frozen = full.host_bytes(args, 2, freeze_embeddings=True, trainers=2)
    trained = n - args.vocab_size * args.hidden_size
    assert frozen["moments"] == 2 * 8 * trained and frozen["weights"] == 2 * n


def test_the_plans_gpu_gradient_buffers_are_the_engines(tmp_path):
    for variant, freeze in (("llama-mha", False), ("qwen3-qknorm-tied", True)):
        model_dir = make_model(tmp_path / variant, variant)
        engine = FullFinetuneEngine(
            DictBlockSource.from_hf(model_dir, torch.float32), freeze_embeddings=freeze
        )
        expected = full.gpu_grad_bytes(engine.args, 4, freeze)
        assert engine.grad_buffer_bytes() == expected, variant


def test_train_refuses_a_full_finetune_the_host_cannot_hold_before_reading_weights(tmp_path):
    avail = host_memory_available()
    # an fp32 weight store of a third of the RAM: a LoRA run fits, 16 B per parameter does not
    model = config_only_7b(tmp_path / "model", avail // 3)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    out = tmp_path / "out"
    argv = ["--model", str(model), "--data", str(data), "--output", str(out), "--device", "cpu"]
    p = CliRunner().invoke(main, ["train", *argv, "--finetuning-type", "full"])
    assert p.exit_code == 1
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: --finetuning-type full: host memory needs ")
    assert "weights " in errors[0] and "moments " in errors[0] and "grad buffers " in errors[0]
    assert "--finetuning-type lora" in errors[0]
    assert "safetensors" not in p.output  # refused before any weight was looked for
    assert not (out / "run.json").exists()  # nothing started, nothing written


def test_the_plan_counts_the_block_copies_the_engine_makes_and_the_host_side_of_the_floor(
    tmp_path,
):
    from appliance.plan.estimate import plan_input
    from appliance.plan.report import make_plan
    from tests.helpers_model import batch

    model_dir = make_model(tmp_path / "m", "llama-mha", num_hidden_layers=4)
    engine = FullFinetuneEngine(DictBlockSource.from_hf(model_dir, torch.float32), copy_blocks=True)
    ids, labels = batch(4, 16)
    mbs = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    engine.train_step(mbs, 1e-3)
    steady = engine.train_step(mbs, 1e-3)  # block 0 was updated: copied again
    block = engine.weights.block_bytes()
    assert steady.h2d_bytes == full.blocks_uploaded_per_step(4, 0) * block == 7 * block
    assert full.blocks_uploaded_per_step(4, 4) == 4  # resident: once a step, after the update

    p = plan_input(None, "7b", "a10", "8", None, seq_len=2048, micro_batch_size=1,
                   finetuning_type="full")  # fmt: skip
    r = make_plan(p)
    f = r["full_finetune"]
    n = param_count(p.args)
    assert f["trained_parameters"] == n and f["d2h_bytes_per_step"] == 4 * n
    lora = make_plan(plan_input(None, "7b", "a10", "8", None, seq_len=2048, micro_batch_size=1))
    lo, fu = lora["flops_by_part"], r["flops_by_part"]  # engine/flops.py
    assert fu["blocks"] == lo["blocks"] * 8 / 6 and fu["lora"] == 0 and lo["lora"] > 0
    assert fu["attention"] == lo["attention"] and fu["head"] == lo["head"] * 6 / 4
    seconds = [r["h2d_seconds"], f["d2h_seconds"], r["compute_seconds"], f["optimizer_seconds"]]
    assert r["step_seconds_floor"] == max(seconds)
    assert r["host_bytes"]["optimizer_state"] == 16 * n  # master, moments, gradients (bf16)


def test_doctor_measures_this_hosts_adamw_rate():
    status, detail, fix = full.adamw_check(params=1_000_000)
    assert status == "ok" and fix == ""
    assert detail.startswith("fused CPU AdamW: ") and "s a step for a 7B full fine-tune" in detail
