"""`appliance plan`: its numbers against arithmetic done by hand here, auto M, flags it names.

The hand computations below restate the engine's rules in plain numbers (Llama-2 shapes, bf16,
LoRA rank 16 on all seven projections, an A10 whose driver reports 23028 MiB, budget 90 %).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from appliance.bench.synthetic import SyntheticBlockSource
from appliance.cli.main import main
from appliance.config import TrainConfig
from appliance.engine.device_weights import DeviceWeights
from appliance.engine.memory import (
    CUDA_MARGIN_BYTES,
    effective_budget,
    plan_memory,
    streaming_budget,
)
from appliance.hardware import gpus as hardware
from appliance.models import block_param_count
from appliance.models.presets import PRESETS
from appliance.plan.estimate import (
    PlanInput,
    block_bytes,
    choose_micro_batches,
    dequant_bytes,
    evaluate,
    globals_bytes,
    lora_param_count,
    plan_input,
)
from appliance.plan.report import make_plan

OLD_SHAPE = ("--seq-len", "2048", "--micro-batch-size", "1", "--micro-batches-per-step", "8")
A10_BUDGET = int(0.9 * 23028 * 2**20)  # the engine's default budget: 90 % of what the card has
A10_B, A10_P = 25e9, 70e12


def f_7b(
    tokens: int,
    block_params: int = 202_383_360,
    layers: int = 32,
    width: int = 4096,
    inter: int = 11008,
    kv: int = 4096,
) -> float:
    """F (engine/flops.py) of a Llama-2 LoRA step of `tokens` in rows of 2048, by hand: the
    blocks' 6·N·T, LoRA r16 on all seven projections 8·n·T, causal attention 16 · T(T+1)/2 ·
    width a row and block, the head 4·V·C·T."""
    lora = layers * 16 * (2 * (width + width) + 2 * (width + kv) + 3 * (width + inter))
    rows = tokens // 2048
    attention = 16 * rows * (2048 * 2049 // 2) * width * layers
    return (
        6 * layers * block_params * tokens
        + 8 * lora * tokens
        + attention
        + 4 * 32000 * width * tokens
    )


def plan_7b(**kw) -> PlanInput:
    return PlanInput(PRESETS["7b"].args, "7b", "a10", seq_len=2048, micro_batch_size=1, **kw)


def test_llama2_7b_on_an_a10_equals_the_hand_computation():
    # one block: q, k, v, o 4096×4096; gate, up, down 4096×11008; two norms of 4096
    block_params = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert block_params == 202_383_360
    block = block_params * 2  # bf16; every tensor's bytes are already a multiple of 64
    globals_ = (2 * 32000 * 4096 + 4096) * 2  # embeddings, LM head, final norm
    lora = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008)) * 16  # fp32 param, grad, 2 moments
    tokens = 8 * 2048
    saved = 32 * tokens * 4096 * 2
    # the step's last hidden states and their gradients (bf16), one micro-batch through a block,
    # and the head's fp32 logits (and softmax, gradient) 2**24 values at a time
    work = 2 * tokens * 4096 * 2 + 2048 * (6 * 4096 + 4 * 11008) * 2 * 2 + 2**24 * 4 * 3
    free = A10_BUDGET - globals_ - lora - work
    assert saved <= free // 2  # activations stay on the GPU
    assert free - saved >= 32 * block  # so every block stays resident

    r = make_plan(plan_7b(micro_batches_per_step=8, tokens=10_000_000))
    assert r["block_bytes"] == block
    assert r["weight_store_bytes"] == globals_ + 32 * block
    assert r["gpu_bytes"]["lora_optimizer"] == lora
    assert r["gpu_bytes"]["working_set"] == work
    assert r["gpu_bytes"]["activations"] == saved
    assert (r["resident_blocks"], r["fits"], r["offload_activations"]) == (32, True, False)
    assert r["streamed_bytes_per_step"] == 0
    flops = f_7b(tokens)
    assert r["flops_per_step"] == flops
    assert r["step_seconds_floor"] == pytest.approx(flops / A10_P)
    assert r["tokens_per_second"] == pytest.approx(tokens / (flops / A10_P))
    steps = math.ceil(10_000_000 / tokens)
    assert r["steps"] == steps
    assert r["cost_usd"] == pytest.approx(steps * flops / A10_P / 3600 * 2.448)


def test_llama2_7b_under_a_12gib_budget_streams_19_blocks():
    block = 202_383_360 * 2
    budget = 12 * 2**30
    fixed = (2 * 32000 * 4096 + 4096) * 2 + 39_976_960 * 16  # globals + LoRA state
    # the step's hidden states and their gradients, one micro-batch's block, one head chunk
    work = 2 * 8 * 2048 * 4096 * 2 + 2048 * (6 * 4096 + 4 * 11008) * 4 + 2**24 * 12
    saved = 32 * 8 * 2048 * 4096 * 2
    free = budget - fixed - work - saved  # activations fit in half of what is left: on the GPU
    resident = free // block - 2  # two slots for the blocks in flight
    assert resident == 13
    uploads = 2 * (32 - 13) - 1  # forward + backward, less block 0 kept for the next forward

    # asked for 12 GiB + the CUDA margin: 12 GiB usable (planner.effective_budget)
    r = evaluate(plan_7b(gpu_memory_budget=budget + CUDA_MARGIN_BYTES), 8)
    assert r["resident_blocks"] == 13
    assert r["gpu_bytes"]["streaming_slots"] == 2 * block
    assert r["blocks_uploaded_per_step"] == uploads == 37
    assert r["streamed_bytes_per_step"] == 37 * block
    assert r["h2d_seconds"] == pytest.approx(37 * block / A10_B)
    assert r["crossover_tokens_per_step"] == pytest.approx(
        37 * block * A10_P / (A10_B * f_7b(8 * 2048) / (8 * 2048))
    )


def test_llama2_70b_on_an_a10_equals_the_hand_computation():
    # q, o 8192×8192; k, v 1024×8192 (8 KV heads of 128); gate, up, down 8192×28672
    block_params = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672 + 2 * 8192
    block = block_params * 2
    globals_ = (2 * 32000 * 8192 + 8192) * 2
    lora = 80 * 16 * (2 * 16384 + 2 * (8192 + 1024) + 3 * (8192 + 28672)) * 16
    tokens = 8 * 2048
    saved = 80 * tokens * 8192 * 2
    work = 2048 * (6 * 8192 + 4 * 28672) * 4 + 2**24 * 12  # one head chunk
    free = A10_BUDGET - globals_ - lora - work
    assert saved > free // 2  # activations go to pinned host memory
    free -= 2 * saved // 80  # and come back two blocks' worth at a time, through device slots
    resident = free // block - 2
    assert resident == 6
    uploads = 2 * (80 - 6) - 1
    flops = f_7b(tokens, block_params, 80, 8192, 28672, 1024)

    r = make_plan(replace(plan_7b(micro_batches_per_step=8), args=PRESETS["70b"].args))
    assert r["resident_blocks"] == 6 and r["gpu_fits"]
    assert r["offload_activations"] and r["host_bytes"]["offloaded_activations"] == saved
    assert r["gpu_bytes"]["activations"] == 2 * saved // 80
    assert r["streamed_bytes_per_step"] == uploads * block
    assert r["flops_per_step"] == flops
    assert r["step_seconds_floor"] == pytest.approx(max(uploads * block / A10_B, flops / A10_P))
    # 138 GB of bf16 weights do not fit the g5.8xlarge's 128 GiB: the plan says so, and how
    assert r["weight_store_bytes"] == globals_ + 80 * block
    assert not r["host_fits"] and not r["fits"]
    assert any("--base-quant int8" in f for f in r["fixes"])


def test_auto_picks_the_smallest_m_within_10_percent_of_compute_bound():
    p = replace(
        plan_7b(micro_batches_per_step=None),
        seq_len=256,
        gpu_memory_budget=4 * 2**30 + CUDA_MARGIN_BYTES,
    )
    m, why = choose_micro_batches(p)
    assert m == 6 and "smallest" in why
    at, below = evaluate(p, 6), evaluate(p, 5)
    assert at["fits"] and at["h2d_seconds"] <= 1.1 * at["compute_seconds"]
    assert below["fits"] and below["h2d_seconds"] > 1.1 * below["compute_seconds"]
    assert make_plan(p)["micro_batches_per_step"] == 6


def test_a_plan_that_cannot_fit_names_the_flag():
    p = replace(plan_7b(micro_batches_per_step=1), micro_batch_size=64, seq_len=4096)
    r = make_plan(p)
    assert not r["gpu_fits"] and not r["fits"]
    assert any(f.startswith("lower --micro-batch-size to ") for f in r["fixes"])
    assert any(f.startswith("lower --seq-len to ") for f in r["fixes"])
    suggested = int(next(f for f in r["fixes"] if "--micro-batch-size" in f).split()[-1])
    assert evaluate(replace(p, micro_batch_size=suggested), 1)["gpu_fits"]  # the fix works


def test_block_and_global_bytes_match_the_engines_own_count():
    args = PRESETS["tiny"].args
    source = SyntheticBlockSource(args, torch.bfloat16)
    weights = DeviceWeights(source, torch.device("cpu"), torch.bfloat16)
    assert block_bytes(args, 2) == weights.block_bytes()
    assert globals_bytes(args, 2) == sum(t.numel() * 2 for t in weights.globals.values())
    from appliance.models.lora import LoraSpec, LoraWeights

    spec = LoraSpec(rank=8)
    assert lora_param_count(args, 8, spec.targets) == LoraWeights(args, spec).num_parameters()


@pytest.mark.parametrize("base_quant", ["none", "int8", "nf4"])
def test_the_plans_memory_inputs_are_the_engines(base_quant):
    """What `appliance plan` gives the memory planner is what the engine gives it (plan_inputs),
    a quantized base's dequantized block included: on an H100 the plan for 70b NF4 under 24 GiB
    kept 35 blocks resident, the engine 31, before the plan counted that transient."""
    from appliance.engine.step import StreamedEngine
    from appliance.models.lora import LoraSpec, LoraWeights
    from appliance.plan.estimate import memory_plan

    args = PRESETS["tiny"].args
    source = SyntheticBlockSource(args, torch.bfloat16, base_quant=base_quant)
    lora = LoraWeights(args, LoraSpec(rank=8))
    ids = torch.zeros(2, 128, dtype=torch.long)
    with StreamedEngine(source, lora, device="cpu", dtype=torch.bfloat16) as engine:
        engine_inputs = engine.plan_inputs([(ids, ids)] * 4)
    p = PlanInput(args, "tiny", "a10", seq_len=128, micro_batch_size=2, base_quant=base_quant,
                  lora_rank=8)  # fmt: skip
    budget = 2**30
    assert memory_plan(replace(p, gpu_memory_budget=budget), 4) == plan_memory(
        args, budget=replace(p, gpu_memory_budget=budget).budget, **engine_inputs
    )
    if base_quant != "none":
        assert dequant_bytes(args, 2, base_quant) == engine.weights.dequant_bytes() > 0


def test_quantized_blocks_count_int8_scales_and_nf4_absmax():
    args = PRESETS["7b"].args
    linear = 4 * 4096 * 4096 + 3 * 4096 * 11008
    rows = 4 * 4096 + 2 * 11008 + 4096  # output rows of q, k, v, o, gate, up, down
    norms = 2 * 4096 * 2
    assert block_bytes(args, 2, "int8") == linear + rows * 4 + norms
    assert block_bytes(args, 2, "nf4") == linear // 2 + linear // 64 * 4 + norms


def preset_config(tmp_path, preset: str, **changes) -> Path:
    """A config.json alone (no weights) of a preset's shape, with `changes`, in `tmp_path`."""
    a = PRESETS[preset].args
    config = {
        "architectures": [a.architecture],
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "max_position_embeddings": a.max_position_embeddings,
        "rms_norm_eps": a.rms_norm_eps,
        **changes,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_seq_len_train_refuses_is_refused_by_plan_too(tmp_path):
    """plan said `fits: yes` for Mistral-7B-v0.1 (sliding_window 4096) at --seq-len 8192, which
    train refuses: plan takes train's rule, and both say the --seq-len to give."""
    model = preset_config(
        tmp_path,
        "7b",
        architectures=["MistralForCausalLM"],
        num_key_value_heads=8,
        max_position_embeddings=32768,
        sliding_window=4096,
    )
    argv = ["plan", "--model", str(model), "--gpu", "a10", "--micro-batch-size", "1"]
    out = CliRunner().invoke(main, [*argv, "--seq-len", "8192"])
    assert out.exit_code == 1
    assert out.output.splitlines() == [
        "error: --seq-len 8192 exceeds the model's sliding_window (4096); sliding-window "
        "attention is not implemented for MistralForCausalLM: give --seq-len 4096 or less"
    ]
    assert CliRunner().invoke(main, [*argv, "--seq-len", "4096"]).exit_code == 0


def test_cli_json_reads_config_json_only(tmp_path):
    model = preset_config(tmp_path, "7b", max_position_embeddings=4096, rms_norm_eps=1e-5)
    argv = [  # no weights at all
        "plan",
        "--model",
        str(model),
        "--gpu",
        "a10",
        "--steps",
        "100",
        "--json",
        *OLD_SHAPE,
    ]
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)
    for key in (
        "weight_store_bytes",
        "streamed_bytes_per_step",
        "flops_per_step",
        "h2d_bytes_per_second",
        "flops_per_second",
        "step_seconds_floor",
        "tokens_per_step",
        "tokens_per_second",
        "fits",
        "gpu_bytes",
        "host_bytes",
        "micro_batches_per_step",
        "cost_usd",
    ):
        assert key in r, key
    preset = make_plan(replace(plan_7b(micro_batches_per_step=8), steps=100))
    assert r["flops_per_step"] == preset["flops_per_step"]
    assert r["cost_usd"] == pytest.approx(preset["cost_usd"])
    assert r["h2d_bytes_per_second"] == hardware.GPUS["a10"].h2d_bytes_per_second


def test_cli_reports_every_bad_flag_at_once():
    argv = ["plan", "--preset", "7b", "--gpu", "a10", "--micro-batches-per-step", "0"]
    out = CliRunner().invoke(main, [*argv, "--tokens", "5", "--steps", "5", "--gpus", "0"])
    assert out.exit_code == 1
    assert "error: --gpus must be ≥ 1 (got 0)" in out.output
    assert "error: --micro-batches-per-step must be ≥ 1 or auto" in out.output
    assert "error: --tokens and --steps are exclusive" in out.output
    assert "Traceback" not in out.output


def test_gpu_base_quant_and_dtype_are_choices_that_click_checks():
    for flag, typo, choices in (
        ("--gpu", "a1O", "'a10', 'a10g', '4090', 'l4', 'l40s', 'a100', 'h100', 'h200'"),
        ("--base-quant", "nf5", "'none', 'int8', 'nf4'"),
        ("--dtype", "bf16", "'float32', 'bfloat16', 'float16'"),
    ):
        argv = ["plan", "--preset", "7b", "--gpu", "a10", flag, typo]
        out = CliRunner().invoke(main, argv)
        assert out.exit_code == 2 and "Traceback" not in out.output
        assert f"Invalid value for '{flag}': '{typo}' is not one of {choices}." in out.output


def test_cli_text_names_the_fix_when_it_does_not_fit_and_exits_1():
    argv = ["plan", "--preset", "70b", "--gpu", "a10", *OLD_SHAPE[:4]]
    argv += ["--micro-batches-per-step", "auto"]
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == 1, out.output
    assert "fits: NO" in out.output and "--base-quant int8" in out.output
    out = CliRunner().invoke(main, [*argv, "--base-quant", "int8", "--tokens", "1000000"])
    assert out.exit_code == 0, out.output
    assert "fits: yes" in out.output and "cost ≥ $" in out.output
    out = CliRunner().invoke(main, [*argv, "--json"])  # --json too: the status says it
    assert out.exit_code == 1 and json.loads(out.output)["fits"] is False


def fix_flags(fix: str) -> list[str]:
    """The flags a suggested fix names, as argv: `lower --seq-len to 2048 and --base-quant nf4`
    → ["--seq-len", "2048", "--base-quant", "nf4"]."""
    return [
        x for flag, value in re.findall(r"(--[a-z-]+) (?:to )?(\w+)", fix) for x in (flag, value)
    ]


def test_host_ram_that_does_not_fit_is_said_and_every_fix_fits_gpu_and_host(tmp_path):
    """70B on an A10 at 32768 × 4 × 8: the GPU needs far more than the card and the host 1413 GiB
    of the g5.8xlarge's 128. Lowering --seq-len alone fixes the GPU, not the host: the fix says
    what else (and following it fits). (The 70b preset's shape with a 32768-token context, as
    Llama 2 70B's 4096 refuses --seq-len 32768.)"""
    model = preset_config(tmp_path, "70b", max_position_embeddings=32768)
    argv = ["plan", "--model", str(model), "--gpu", "a10", "--seq-len", "32768"]
    argv += ["--micro-batch-size", "4", "--micro-batches-per-step", "8"]
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == 1, out.output
    verdict = next(line for line in out.output.splitlines() if line.startswith("fits: NO"))
    assert "GPU memory: needs at least 151.4 GiB, the budget is 19.5 GiB" in verdict
    assert "host RAM: needs 1413 GiB of the g5.8xlarge's 128 GiB" in verdict
    assert "weight store 128 GiB (--base-quant shrinks it)" in verdict
    assert "activations offloaded to host 1280 GiB" in verdict
    r = json.loads(CliRunner().invoke(main, [*argv, "--json"]).output)
    assert r["fixes"] == ["lower --seq-len to 2048 and --base-quant nf4"]
    assert r["host_ram_bytes"] == 128 * 2**30 and not r["host_fits"]

    # following the advice on the GPU alone still fails on host RAM: the plan says so, and
    # every change it offers fits both
    argv[argv.index("--seq-len") + 1] = "2048"
    r = json.loads(CliRunner().invoke(main, [*argv, "--json"]).output)
    assert r["gpu_fits"] and not r["host_fits"]
    assert r["problems"] == [
        "host RAM: needs 213 GiB of the g5.8xlarge's 128 GiB: weight store 128 GiB (--base-quant "
        "shrinks it), activations offloaded to host 80 GiB (fewer, smaller or shorter "
        "micro-batches shrink them), processes 5 GiB"
    ]
    assert "--base-quant nf4" in r["fixes"] and not any("int8" in f for f in r["fixes"])
    assert r["fixes"][-1] == "a host with 213 GiB of RAM or more"
    for fix in r["fixes"][:-1]:
        out = CliRunner().invoke(main, [*argv, *fix_flags(fix)])
        assert out.exit_code == 0 and "fits: yes" in out.output, (fix, out.output)


@pytest.mark.parametrize(
    "budget, error",
    [
        ("0", "--gpu-memory-budget 0 leaves nothing to plan: the engine keeps 768 MiB of any "
         "budget for cuBLAS, NCCL and fragmentation; give more (e.g. 20GiB), or leave it out "
         "for 90% of the card"),
        ("768MiB", "--gpu-memory-budget 768MiB leaves nothing to plan: the engine keeps 768 MiB"),
        ("24", "--gpu-memory-budget 24 is 24 bytes: did you mean 24GiB?"),
    ],
)  # fmt: skip
def test_a_budget_that_leaves_nothing_is_one_error_line(budget, error):
    """0 printed "budget -0.75 GiB" and offered `--gpu l4`; 24 was read as 24 bytes."""
    argv = ["plan", "--preset", "7b", "--gpu", "a10", "--gpu-memory-budget", budget]
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output
    lines = out.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {error}"), out.output


def without_budget(argv: list[str], fix: str) -> list[str]:
    """`argv` changed as `fix` says: its flags set, the budget dropped when it says to."""
    if "without --gpu-memory-budget" in fix or fix.startswith("drop --gpu-memory-budget"):
        i = argv.index("--gpu-memory-budget")
        argv = argv[:i] + argv[i + 2 :]
    flags = [] if fix.startswith("drop ") else fix_flags(fix)
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        if flag in argv:
            argv = [*argv]
            argv[argv.index(flag) + 1] = value
        else:
            argv = [*argv, flag, value]
    return argv


@pytest.mark.parametrize(
    "argv, gpu_fix",
    [
        # the budget alone is what does not fit: dropping it is the fix, no other card
        (["--preset", "7b", "--gpu-memory-budget", "2GiB"], None),
        # another card that keeps the budget (more host RAM)
        (["--preset", "70b", "--gpu-memory-budget", "12GiB"], "--gpu 4090 (24 GiB GPU"),
        # no budget on this card fits: another card, without it, said so
        (
            ["--preset", "70b", "--gpu-memory-budget", "6GiB", "--seq-len", "4096",
             "--micro-batch-size", "1", "--micro-batches-per-step", "64"],
            "--gpu a100 without --gpu-memory-budget (40 GiB GPU",
        ),
    ],
)  # fmt: skip
def test_a_gpu_fix_keeps_the_budget_or_says_it_drops_it(argv, gpu_fix):
    """`--gpu a10 --gpu-memory-budget 2GiB` offered `--gpu l4`, which fitted only because the
    budget was silently dropped. Each fix, followed as it reads, fits (a card with no more GPU
    memory than the one given included: it is offered only so)."""
    argv = ["plan", "--gpu", "a10", *argv]
    r = json.loads(CliRunner().invoke(main, [*argv, "--json"]).output)
    assert not r["fits"]
    gpu_fixes = [f for f in r["fixes"] if f.startswith("--gpu ")]
    if gpu_fix is None:
        assert gpu_fixes == [] and "drop --gpu-memory-budget" in r["fixes"][-1]
    else:
        assert len(gpu_fixes) == 1 and gpu_fixes[0].startswith(gpu_fix), r["fixes"]
    for fix in r["fixes"]:
        if fix.startswith("a host with"):
            continue
        out = CliRunner().invoke(main, without_budget(argv, fix))
        assert out.exit_code == 0 and "fits: yes" in out.output, (fix, out.output)


def test_gpu_names_are_taken_in_any_case():
    p = plan_input(None, "7b", "A10", "4", None)
    assert p.gpu == "a10" and p.card is hardware.GPUS["a10"]
    p = plan_input(None, "7b", "L40S", "4", "20GiB")
    assert p.gpu == "l40s" and p.gpu_memory_budget == 20 * 2**30


def test_plan_assumes_trains_shape_and_prints_it(tmp_path):
    train = TrainConfig()
    p = PlanInput(PRESETS["7b"].args, "7b", "a10")
    shape = (p.seq_len, p.micro_batch_size, p.micro_batches_per_step, p.lora_rank, p.base_quant)
    assert shape == (
        train.seq_len,
        train.micro_batch_size,
        train.micro_batches_per_step,
        train.lora_rank,
        train.base_quant,
    )
    assert p.lora_targets == tuple(train.lora_targets)
    out = CliRunner().invoke(main, ["plan", "--preset", "7b", "--gpu", "a10", "--json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)
    # on a GPU, train's rows a micro-batch grow at the same tokens a step (plan/shape.py)
    assert (r["seq_len"], r["micro_batch_size"], r["micro_batches_per_step"]) == (256, 16, 1)
    assert r["tokens_per_step"] == 256 * train.micro_batch_size * train.micro_batches_per_step
    assert r["train_defaults"] == ["seq_len", "micro_batch_size", "micro_batches_per_step"]
    text = CliRunner().invoke(main, ["plan", "--preset", "7b", "--gpu", "a10", "--seq-len", "512",
                                     "--micro-batch-size", "4"])  # fmt: skip
    assert (
        "shape: --seq-len 512 (given), --micro-batch-size 4 (given), --micro-batches-per-step "
        f"{train.micro_batches_per_step} (train's default)\n"
    ) in text.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_a_gpu_keeps_the_blocks_the_plan_predicts():
    from appliance.engine.step import StreamedEngine
    from appliance.models.lora import LoraSpec, LoraWeights

    args = PRESETS["tiny"].args
    source = SyntheticBlockSource(args, torch.bfloat16)
    block = block_bytes(args, 2)
    p = PlanInput(args, "tiny", "a10", seq_len=128, micro_batch_size=2)
    # the least usable budget and room for a few resident blocks, and what the engine keeps off
    # any budget for CUDA (gpu_min_bytes is usable bytes, after that margin)
    budget = CUDA_MARGIN_BYTES + evaluate(p, 4)["gpu_min_bytes"] + 2 * block
    p = replace(p, gpu_memory_budget=budget)
    lora = LoraWeights(args, LoraSpec(), "cuda")
    ids = torch.zeros(2, 128, dtype=torch.long)
    with StreamedEngine(
        source, lora, device="cuda", dtype=torch.bfloat16, gpu_memory_budget=budget
    ) as engine:
        engine.plan([(ids, ids)] * 4)
        assert len(engine.weights.resident) == evaluate(p, 4)["resident_blocks"]


# ---------------------------------------------------------------- train --micro-batches-per-step auto


def _cfg(tmp_path, **flags):
    from appliance.config import build_config

    base = {"model": str(tmp_path / "m"), "data": str(tmp_path / "d"), "output": str(tmp_path)}
    return build_config({}, {**base, **flags})


def test_config_accepts_auto_and_still_checks_numbers(tmp_path):
    from appliance.errors import ConfigError

    assert _cfg(tmp_path, micro_batches_per_step="auto").micro_batches_per_step == "auto"
    assert _cfg(tmp_path, micro_batches_per_step="3").micro_batches_per_step == 3
    with pytest.raises(ConfigError, match="--micro-batches-per-step must be ≥ 1"):
        _cfg(tmp_path, micro_batches_per_step="0")
    with pytest.raises(ConfigError, match="--micro-batches-per-step: 'many' is not a valid int"):
        _cfg(tmp_path, micro_batches_per_step="many")


def test_auto_on_a_cpu_means_4_and_run_json_records_it(tmp_path):
    from appliance.run.driver import resolve_micro_batches
    from appliance.run.progress import Progress
    from appliance.run.record import write_run_file
    from appliance.run.state import Inputs

    cfg = _cfg(tmp_path, micro_batches_per_step="auto")
    inp = Inputs(cfg, tmp_path, tmp_path, 2, None, "cpu", "float32")
    resolve_micro_batches(inp, Progress("plain"))
    assert cfg.micro_batches_per_step == 4
    write_run_file(cfg, "running")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["micro_batches_per_step"] == 4
    assert record["identity"]["micro_batches_per_step"] == 4
    # --resume with auto continues with the M the run started with
    from appliance.run.resume import decide_output

    resumed = _cfg(tmp_path, micro_batches_per_step="auto", resume="true")
    decision = decide_output(resumed)
    assert decision.micro_batches_per_step == 4
    assert decision.applied_to(resumed).micro_batches_per_step == 4
    assert resumed.micro_batches_per_step == "auto"  # the config given is not changed


def test_auto_on_a_gpu_uses_plans_rule_with_the_measured_figures():
    from appliance.plan.auto import auto_micro_batches

    measured = {  # what an A10 would measure if it matched the table
        "h2d_bytes_per_second": A10_B,
        "flops_per_second": A10_P,
        "memory_bytes": 23028 * 2**20,
        "name": "NVIDIA A10",
    }
    args = PRESETS["7b"].args
    m, why = auto_micro_batches(
        args,
        measured,
        seq_len=256,
        micro_batch_size=1,
        lora_rank=16,
        lora_targets=tuple(plan_7b().lora_targets),
        dtype_bytes=2,
        budget=4 * 2**30 + CUDA_MARGIN_BYTES,  # 4 GiB usable
    )
    assert (m, why) == (6, "the smallest M within 10% of compute-bound that fits")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_this_gpu_gives_plausible_figures():
    from appliance.plan.auto import measure_this_gpu

    m = measure_this_gpu()
    assert 1e9 < m["h2d_bytes_per_second"] < 1e12 and 1e12 < m["flops_per_second"] < 1e16


def test_gpus_multiply_tokens_not_the_step_time():
    one = make_plan(plan_7b(micro_batches_per_step=8, tokens=10_000_000))
    two = make_plan(plan_7b(micro_batches_per_step=8, tokens=10_000_000, gpus=2))
    assert two["tokens_per_step"] == 2 * one["tokens_per_step"]
    assert two["step_seconds_floor"] == one["step_seconds_floor"]  # each GPU streams the same
    assert two["steps"] == math.ceil(one["steps"] / 2)
    assert two["cost_usd"] == pytest.approx(
        two["steps"] * one["step_seconds_floor"] / 3600 * 2.448 * 2
    )
    assert two["weight_store_bytes"] == one["weight_store_bytes"]  # one store per node


def test_the_effective_budget_never_trusts_more_than_the_card_has_free():
    G = 2**30
    # default: 90% of the card, when that much is free
    assert effective_budget(None, 24 * G, 23 * G, 0) == int(24 * G * 0.9) - CUDA_MARGIN_BYTES
    # a budget larger than the card: what is free is the limit
    assert effective_budget(80 * G, 24 * G, 23 * G, 0) == 23 * G - CUDA_MARGIN_BYTES
    # another process holds memory; what this process's allocator already reserved is usable
    assert effective_budget(None, 24 * G, 10 * G, 2 * G) == 12 * G - CUDA_MARGIN_BYTES
    # a budget that fits is taken, less the margin
    assert effective_budget(20 * G, 24 * G, 23 * G, 0) == 20 * G - CUDA_MARGIN_BYTES


@pytest.mark.parametrize("preset", ["7b", "13b", "70b", "1b"])
def test_streaming_budget_is_the_largest_that_streams_half_the_blocks(preset):
    """What `appliance bench` runs its streamed row at by default: at that budget the plan fits
    and streams at least half the blocks; a quarter block more and it streams fewer."""
    args = PRESETS[preset].args
    inputs = dict(
        dtype_bytes=2, tokens=8 * 2048, biggest=2048, longest=2048,
        block_bytes=block_param_count(args) * 2,
        globals_bytes=(2 - args.tie_word_embeddings) * args.vocab_size * args.hidden_size * 2,
        lora_params=0,
    )  # fmt: skip
    budget = streaming_budget(args, **inputs)
    L = args.num_layers
    p = plan_memory(args, budget=budget - CUDA_MARGIN_BYTES, **inputs)
    assert p.fits and L - p.resident_blocks >= L / 2
    step = max(2**20, min(256 * 2**20, inputs["block_bytes"] // 4 // 2**20 * 2**20))
    more = plan_memory(args, budget=budget - CUDA_MARGIN_BYTES + step, **inputs)
    assert L - more.resident_blocks < L / 2
