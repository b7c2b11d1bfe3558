"""`appliance bench`: the tiny preset end to end on a CPU; the 1b preset streamed on a GPU.

No timing is asserted: only that every number is measured, consistent and written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from appliance.bench import cli as BC
from appliance.bench import step as B
from appliance.bench.table import format_table, write_json
from appliance.engine.flops import lora_active_params, step_flops
from appliance.engine.step import StreamedEngine
from appliance.errors import ConfigError
from appliance.models import (
    active_block_param_count,
    block_param_count,
    block_shapes,
    param_count,
)
from appliance.models.hf_checkpoint import block_names, read_model_args
from appliance.models.lora import LoraSpec, LoraWeights
from tests.helpers_model import write_config

# one short micro-batch a step: the tiny preset's CPU shape (several of 128 tokens) costs a step
# of seconds, and no test that takes this shape reads a number that depends on it
SMALL = ["--micro-batch-size", "1", "--seq-len", "32", "--micro-batches-per-step", "1"]

ROW_FIELDS = {
    "mode", "tokens_per_step", "fits", "resident_blocks", "blocks", "streamed_bytes",
    "step_seconds", "step_seconds_min", "tokens_per_second", "flops_per_step",
    "floor_h2d_seconds", "floor_compute_seconds", "floor_seconds", "ratio",
    "h2d_bytes_per_step", "h2d_seconds_per_step", "h2d_stall_seconds_per_step",
    "offload_h2d_bytes_per_step", "expert_share",
    "gpu_busy_seconds_per_step", "gpu_busy_ratio", "host_issue_ratio", "phase_seconds", "losses",
    "peak_gpu_bytes",
    "streamed_blocks", "bandwidth_bytes_per_second", "step_seconds_median",
    "dequant_seconds_per_step", "dequant_share", "nvml_util_mean", "profile",
    "crossover_tokens_per_step", "flops_by_part", "elementwise_bytes_per_step",
    "floor_elementwise_seconds", "issue_lag",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`python -m appliance.bench --preset tiny ... --json F`, run in-process."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--micro-batch-size", "1", "--seq-len", "32",
            "--micro-batches-per-step", "2", "--steps", "2", "--json", str(path)]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = BC.main(argv)
    return rc, out.getvalue(), json.loads(path.read_text())


def test_tiny_on_cpu_measures_every_field(tiny_run):
    rc, _, result = tiny_run
    assert rc == 0
    args = B.PRESETS["tiny"].args
    assert result["preset"] == "tiny" and result["device"] == "cpu"
    assert result["dtype"] == "float32"
    assert result["shape"]["tokens_per_step"] == 1 * 32 * 2
    assert result["model"]["params"] == param_count(args)
    assert result["bandwidth"]["bytes_per_second"] > 0
    assert "memcpy" in result["bandwidth"]["kind"]
    assert result["matmul"]["flops_per_second"] > 0
    assert "float32" in result["matmul"]["kind"]
    assert result["host"]["cpus"] >= 1 and result["date"]
    assert result["base_quant"] == "none" and result["dequant_kernels"] is None

    streamed, resident = result["modes"]
    assert (streamed["mode"], resident["mode"]) == ("streamed", "resident")
    block_bytes = block_param_count(args) * 4
    # nominal on CPU: as if every block streamed, each copied once per pass but block 0, which
    # stays from a step's backward into the next forward, and the last, from forward to backward
    L = args.num_layers
    assert (
        streamed["streamed_blocks"] == L and streamed["streamed_bytes"] == (2 * L - 2) * block_bytes
    )
    assert resident["streamed_blocks"] == 0 and resident["streamed_bytes"] == 0
    for row in (streamed, resident):
        assert set(row) == ROW_FIELDS, set(row) ^ ROW_FIELDS
        assert row["fits"] and row["tokens_per_step"] == 64
        assert row["peak_gpu_bytes"] is None  # measured on CUDA only
        assert row["offload_h2d_bytes_per_step"] == 0  # activations are offloaded on CUDA only
        assert row["step_seconds"] > 0 and row["tokens_per_second"] > 0
        # F (engine/flops.py): the engine's count is the bench's, by part
        lora = lora_active_params(args, LoraSpec().rank, LoraSpec().targets)
        f = step_flops(args, [(1, 32)] * 2, lora_params=lora)
        assert row["flops_per_step"] == f.total == row["flops_by_part"]["total"]
        assert f.blocks == 6 * args.num_layers * block_param_count(args) * 64
        # the least elementwise bytes, over the device copy's rate: beside the floor, not in it
        assert row["floor_elementwise_seconds"] == pytest.approx(
            row["elementwise_bytes_per_step"] / result["memory_bandwidth"]["bytes_per_second"]
        )
        assert row["floor_seconds"] > 0 and row["ratio"] > 0
        assert row["floor_seconds"] == max(row["floor_h2d_seconds"], row["floor_compute_seconds"])
        assert math.isclose(
            row["floor_h2d_seconds"], row["streamed_bytes"] / row["bandwidth_bytes_per_second"]
        )
        assert row["dequant_seconds_per_step"] == 0.0  # no --base-quant
        assert row["nvml_util_mean"] is None and row["profile"] is None  # no GPU; not asked
        # T*: where the copies' floor and the compute floor meet, F being linear in the tokens
        assert math.isclose(
            row["crossover_tokens_per_step"] / row["tokens_per_step"],
            row["floor_h2d_seconds"] / row["floor_compute_seconds"],
        )
        assert math.isclose(row["ratio"], row["step_seconds"] / row["floor_seconds"])
        assert math.isclose(
            row["floor_compute_seconds"],
            row["flops_per_step"] / result["matmul"]["flops_per_second"],
        )
        assert len(row["losses"]) == 1 + 2  # warm-up + timed
        assert row["gpu_busy_seconds_per_step"] is None  # CUDA events only
        assert row["host_issue_ratio"] is None  # on a CPU the host does all the work
        assert row["issue_lag"] is None  # nothing recorded on a CPU: no lag to measure
        # random N(0, 0.02) weights give near-uniform predictions: loss ≈ ln(vocab)
        assert abs(row["losses"][0] - math.log(args.vocab_size)) < 0.5
    # on a CPU both modes run the same arithmetic on the same weights and batches
    assert streamed["losses"] == resident["losses"]


def test_table_is_printed_with_one_row_per_mode(tiny_run):
    _, out, result = tiny_run
    assert out.strip() == format_table(result)
    assert "| mode | tokens/step | step s | tokens/s |" in out
    assert "time/floor" in out and "memcpy" in out
    for row in result["modes"]:
        line = next(x for x in out.splitlines() if x.startswith(f"| {row['mode']} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 15
        assert cells[1] == "64" and cells[10] == f"{row['ratio']:.2f}"
        assert cells[12] == "0.0%" and cells[13:] == ["—", "—"]  # no dequant; no GPU on a CPU


def test_the_table_says_when_the_host_is_the_bottleneck(tiny_run):
    """On CUDA each row has the host's issuing share of the step: near 1, the GPU waited for
    kernel launches, and the busy ratio (brackets around launch gaps) does not show it."""
    _, out, result = tiny_run
    assert "the host issued work" not in out  # None on a CPU: the host does everything there

    def table(issue, nvml):
        rows = [{**r, "host_issue_ratio": issue, "nvml_util_mean": nvml} for r in result["modes"]]
        return format_table({**result, "modes": rows}).splitlines()

    assert (
        "streamed: the host issued work for 97% of the step and NVML saw no kernel running 25% "
        "of it (launch-bound: the GPU waited for the host; GPU busy overstates its work)"
    ) in table(0.97, 0.75)
    # a GPU-bound step keeps the host busy too, blocked in launches on a full queue
    assert (
        "streamed: the host issued work for 99% of the step (waiting on the full launch queue: "
        "NVML saw kernels running 93% of it)"
    ) in table(0.99, 0.93)
    assert (
        "resident: the host issued work for 97% of the step (launch-bound, or GPU-bound with the "
        "launch queue full: no NVML reading to tell)"
    ) in table(0.97, None)
    assert "resident: the host issued work for 40% of the step" in table(0.4, 0.9)
    assert not any("bound" in line for line in table(0.4, 0.9) if "40%" in line)


def test_a_resident_mode_that_does_not_fit_is_a_table_row():
    result = {
        "preset": "70b", "dtype": "bfloat16", "device_name": "GPU", "gpu_memory_budget": 2**34,
        "model": {"num_layers": 80, "hidden_size": 8192, "params": 69_000_000_000},
        "shape": {"micro_batches": 8, "micro_batch_size": 1, "seq_len": 2048,
                  "tokens_per_step": 16384, "warmup": 1, "steps": 3},
        "bandwidth": {"bytes_per_second": 2.5e10, "kind": "pinned"},
        "matmul": {"flops_per_second": 1.6e14, "kind": "bf16"},
        "modes": [{"mode": "resident", "tokens_per_step": 16384, "fits": False,
                   "reason": "does not fit: 30 of 80 blocks fit in 24 GiB"}],
    }  # fmt: skip
    table = format_table(result)
    assert "| resident | 16384 | does not fit: 30 of 80 blocks fit in 24 GiB |" in table
    assert "budget: 16 GiB" in table


def test_big_presets_are_refused_on_cpu_with_what_to_do():
    for preset in ("7b", "13b", "70b"):
        with pytest.raises(ConfigError, match=f"--preset {preset} needs a GPU .--device cuda."):
            B.run_bench(preset, "cpu")
    with pytest.raises(ConfigError, match="--gpu-memory-budget applies to --device cuda only"):
        B.run_bench("tiny", "cpu", gpu_memory_budget=2**30)
    with pytest.raises(ConfigError, match="--seq-len must be ≥ 1"):
        B.run_bench("tiny", "cpu", seq_len=-1)
    for flag, kw in (("--micro-batches-per-step", "micro_batches"), ("--steps", "steps")):
        with pytest.raises(ConfigError, match=f"{flag} must be ≥ 1, got 0"):  # 0 is no default
            B.run_bench("tiny", "cpu", **{kw: 0})


def test_cli_prints_user_errors_as_one_line(capsys):
    assert BC.main(["--preset", "70b", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --preset 70b needs a GPU")


def test_a_bad_gpu_memory_budget_is_one_line_naming_the_flag(capsys):
    assert BC.main(["--preset", "tiny", "--device", "cpu", "--gpu-memory-budget", "lots"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --gpu-memory-budget 'lots': 'lots' is not a size like 24GiB"]


def test_a_budget_that_leaves_nothing_is_refused_as_plan_refuses_it(capsys):
    for budget, error in (
        ("24", "--gpu-memory-budget 24 is 24 bytes: did you mean 24GiB?"),
        ("0", "--gpu-memory-budget 0 leaves nothing to plan: the engine keeps 768 MiB"),
    ):
        assert BC.main(["--preset", "tiny", "--device", "cpu", "--gpu-memory-budget", budget]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {error}")


def test_micro_batches_per_step_is_trains_spelling_and_the_old_one_still_works(capsys):
    for flag in ("--micro-batches-per-step", "--micro-batches"):
        assert BC.parser().parse_args([flag, "3"]).micro_batches == 3
    help_text = BC.parser().format_help()
    assert "--micro-batches-per-step N, --micro-batches N" in help_text
    assert BC.main(["--preset", "tiny", "--device", "cpu", "--micro-batches-per-step", "-1"]) == 1
    assert capsys.readouterr().err.strip() == "error: --micro-batches-per-step must be ≥ 1, got -1"


def test_the_json_holds_each_row_as_soon_as_it_is_measured(tmp_path, monkeypatch):
    """A bench killed in its second row (a device call's time limit, an OOM) keeps the first row
    in its --json file, written whole."""
    path = tmp_path / "bench.json"
    real = B._run_mode

    def dies_in_resident(mode, *args):
        if mode == "resident":
            assert [r["mode"] for r in json.loads(path.read_text())["modes"]] == ["streamed"]
            raise MemoryError("the resident row ran out of memory")
        return real(mode, *args)

    monkeypatch.setattr(B, "_run_mode", dies_in_resident)
    argv = ["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", *SMALL]
    with pytest.raises(MemoryError):
        BC.main([*argv, "--json", str(path)])
    kept = json.loads(path.read_text())
    assert [r["mode"] for r in kept["modes"]] == ["streamed"]
    assert kept["shape"]["tokens_per_step"] == kept["modes"][0]["tokens_per_step"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no temp file left


def test_a_json_path_that_cannot_be_written_is_refused_before_the_bench_runs(
    tmp_path, monkeypatch, capsys
):
    """A --json under a file or naming a directory ran the whole bench, then raised a traceback
    (its results lost, a .NAME.tmp left beside a directory): now one error line first."""

    def no_bench(*args, **kwargs):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(BC, "run_bench", no_bench)
    (tmp_path / "afile").write_text("")
    (tmp_path / "somedir").mkdir()
    argv = ["--preset", "tiny", "--device", "cpu", "--json"]
    for path, why in (
        (tmp_path / "afile" / "x.json", f"{tmp_path / 'afile'} is a file, not a directory"),
        (tmp_path / "somedir", "is a directory; give a file name, e.g. --json "),
    ):
        assert BC.main([*argv, str(path)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --json {path}") and why in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "somedir"]
    assert not any((tmp_path / "somedir").iterdir())


def test_write_json_makes_missing_directories_and_never_leaves_its_temp_file(tmp_path, capsys):
    """A missing parent is made (as export makes its --output's); a write that fails leaves no
    .NAME.tmp behind; a bench whose --json stops being writable still prints its table, then
    says so in one line."""
    deep = tmp_path / "new" / "dir" / "x.json"
    write_json({"a": 1}, deep)
    assert json.loads(deep.read_text()) == {"a": 1}
    (tmp_path / "somedir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_json({"a": 1}, tmp_path / "somedir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "somedir"]

    path = tmp_path / "made" / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", *SMALL]
    assert BC.main([*argv, "--modes", "streamed", "--json", str(path)]) == 0
    assert [r["mode"] for r in json.loads(path.read_text())["modes"]] == ["streamed"]
    capsys.readouterr()

    def disk_full(result, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(BC, "write_json", disk_full)
        assert BC.main([*argv, "--modes", "streamed", "--json", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "| streamed |" in out  # the results are printed all the same
    assert err.strip().splitlines() == [
        f"error: --json {path}: not written (No space left on device); the table above holds "
        "the results"
    ]


def test_modes_runs_only_the_rows_asked_for(tmp_path, capsys):
    """--modes streamed: a big model's resident row (several full steps) is left out where only
    the streamed one is wanted (gpu_proof.sh's 70b-nf4); an unknown row is one error line."""
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", *SMALL]
    assert BC.main([*argv, "--modes", "streamed", "--json", str(path)]) == 0
    assert [r["mode"] for r in json.loads(path.read_text())["modes"]] == ["streamed"]
    assert "| resident |" not in capsys.readouterr().out
    assert BC.main([*argv, "--modes", "streamed,idle"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --modes streamed,idle: give one or both of streamed,resident"


def test_synthetic_weights_are_the_same_in_every_process():
    """Two bench runs are comparable (same weights, same losses): the tensor offsets into the
    random pool do not depend on Python's per-process string hash."""
    code = (
        "import torch, zlib; from appliance.bench import step as B; "
        "src = B.SyntheticBlockSource(B.PRESETS['tiny'].args, torch.float32); "
        "print(zlib.crc32(src.flat_block(1)[0].tobytes()))"
    )
    sums = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(sums) == 1, sums


@pytest.mark.parametrize("base_quant", ["none", "nf4"])
def test_synthetic_blocks_made_all_at_once_by_threads_equal_those_made_one_by_one(base_quant):
    """make_all (the bench's: every block made on the host's cores before timing) gives each
    block the bytes and index that making it alone gives."""
    args = B.PRESETS["tiny"].args
    together = B.SyntheticBlockSource(args, torch.bfloat16, base_quant=base_quant)
    together.make_all(threads=3)
    assert sorted(together._flat) == list(range(args.num_layers))
    for i in reversed(range(args.num_layers)):
        alone = B.SyntheticBlockSource(args, torch.bfloat16, base_quant=base_quant)
        buf, index = alone.flat_block(i)
        assert together._flat[i][1] == index
        assert np.array_equal(together._flat[i][0], buf)


def test_synthetic_blocks_are_made_lazily_with_the_checkpoint_layout():
    args = B.PRESETS["tiny"].args
    src = B.SyntheticBlockSource(args, torch.bfloat16)
    assert src.num_blocks == args.num_layers and not src._flat
    w = src.block(2)
    assert list(src._flat) == [2]  # only the block asked for exists
    prefix = "model.layers.2."
    assert sorted(w) == sorted(n[len(prefix) :] for n in block_names(args, 2))
    for key, t in w.items():
        assert t.dtype == torch.bfloat16
        module = key.rsplit(".", 1)[0]
        if "layernorm" in key:
            assert t.shape == (args.hidden_size,) and bool((t == 1).all())
        else:
            assert tuple(t.shape) == args.module_shape(module)
            assert abs(float(t.float().std()) - 0.02) < 0.002
    again = src.block(2)
    assert all(torch.equal(w[k], again[k]) for k in w)
    other = src.block(3)
    assert not torch.equal(w["mlp.up_proj.weight"], other["mlp.up_proj.weight"])
    g = src.globals()
    assert "lm_head.weight" in g and g["model.embed_tokens.weight"].shape == (2048, 256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_1b_streamed_under_a_small_budget_agrees_with_resident():
    budget = 2 * 2**30
    result = B.run_bench(
        "1b", "cuda", torch.bfloat16, budget,
        micro_batch_size=1, seq_len=256, micro_batches=2, steps=2, warmup=1,
    )  # fmt: skip
    streamed, resident = result["modes"]
    assert streamed["fits"], streamed.get("reason")
    assert resident["fits"], resident.get("reason")
    assert "pinned host→device" in result["bandwidth"]["kind"]
    assert "bfloat16" in result["matmul"]["kind"]
    # the budget made blocks stream: some are not resident, and bytes were copied every step
    assert streamed["resident_blocks"] < streamed["blocks"] == 16
    assert streamed["h2d_bytes_per_step"] > 0 and streamed["streamed_bytes"] > 0
    # the bytes the engine really copied are the 2·streamed − 1 blocks the floor counts
    assert streamed["h2d_bytes_per_step"] == streamed["streamed_bytes"]
    # B from the engine's own page-locked block, not a separate buffer
    assert streamed["bandwidth_bytes_per_second"] > 0
    assert resident["resident_blocks"] == 16 and resident["h2d_bytes_per_step"] == 0
    for row in (streamed, resident):
        assert row["floor_seconds"] > 0 and row["ratio"] > 0
        assert 0 < row["gpu_busy_seconds_per_step"] <= row["step_seconds"]
    # the first loss is a forward pass over identical weights and batches: equal; later ones
    # follow AdamW updates from gradients that may differ in their last bits (flash attention)
    s, r = streamed["losses"], resident["losses"]
    assert abs(s[0] - r[0]) <= 1e-6 * abs(r[0])
    for a, b in zip(s, r, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (s, r)


# published parameter counts (Gemma 3 12B: its text part, without the 0.4B vision tower)
FAMILY_PARAMS = {
    "qwen3-8b": 8.19e9,
    "gemma2-9b": 9.24e9,
    "gemma3-12b": 11.77e9,
    "phi4-mini": 3.84e9,
}


@pytest.mark.parametrize("preset", sorted(FAMILY_PARAMS))
def test_family_presets_have_their_models_real_size_and_run_shrunk_on_a_cpu(preset):
    args = B.PRESETS[preset].args
    assert abs(param_count(args) / FAMILY_PARAMS[preset] - 1) < 0.01, param_count(args)
    # the same family and features at a tiny width: the synthetic source builds its blocks and
    # a streamed step runs on them (windows and soft caps on: seq_len 32 > 16)
    tiny = dataclasses.replace(
        args, vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2 if
        args.layer_types is None else 6, num_heads=4, num_kv_heads=2, head_dim=16,
        sliding_window=16,
        layer_types=args.layer_types and args.layer_types[:6],
        rope_scaling=None if args.partial_rotary_factor == 1 else (
            ("long_factor", (1.0,) * 6), ("original_max_position_embeddings", 16.0),
            ("rope_type", "longrope"), ("short_factor", (1.0,) * 6)),
    )  # fmt: skip
    src = B.SyntheticBlockSource(tiny, torch.float32)
    w = src.block(1)
    assert {k: tuple(t.shape) for k, t in w.items()} == block_shapes(tiny)
    ids = torch.randint(0, 128, (2, 32))
    stats = StreamedEngine(src, LoraWeights(tiny, LoraSpec(rank=2))).train_step([(ids, ids)], 1e-3)
    assert math.isfinite(stats.loss)


# mixtures of experts: (published total, active, vocabulary matrices the active count adds to
# the blocks' active parameters): Qwen counts the embeddings and the LM head, OpenAI the head
MOE_PARAMS = {"qwen3-30b-a3b": (30.5e9, 3.3e9, 2), "gpt-oss-20b": (20.9e9, 3.6e9, 1)}


@pytest.mark.parametrize("preset", sorted(MOE_PARAMS))
def test_moe_presets_have_their_models_real_size_and_flops_count_the_active_parameters(preset):
    args = B.PRESETS[preset].args
    total, active, vocab_matrices = MOE_PARAMS[preset]
    assert abs(param_count(args) / total - 1) < 0.01, param_count(args)
    blocks = args.num_layers * active_block_param_count(args)
    assert abs((blocks + vocab_matrices * args.vocab_size * args.hidden_size) / active - 1) < 0.02
    assert step_flops(args, [(1, 100)]).blocks == 6 * blocks * 100  # N_active, the router too
    # shrunk (8 experts, narrow), the synthetic source builds its blocks and a step runs
    tiny = dataclasses.replace(
        args, vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, num_experts=8, moe_intermediate_size=32, sliding_window=16,
        layer_types=args.layer_types and args.layer_types[:2],
    )  # fmt: skip
    src = B.SyntheticBlockSource(tiny, torch.float32)
    assert {k: tuple(t.shape) for k, t in src.block(1).items()} == block_shapes(tiny)
    ids = torch.randint(0, 128, (2, 32))
    stats = StreamedEngine(src, LoraWeights(tiny, LoraSpec(rank=2))).train_step([(ids, ids)], 1e-3)
    assert math.isfinite(stats.loss)


# the released config.json fields of each family preset's model (transformers writes the rest)
RELEASED = {
    "qwen3-8b": ("Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6, rope_parameters=None,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "gemma2-9b": ("Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, rms_norm_eps=1e-6, layer_types=None)),
    "gemma3-12b": ("Gemma3ForCausalLM", dict(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_parameters=None,
        _sliding_window_pattern=None, layer_types=None,
        max_position_embeddings=131072, rms_norm_eps=1e-6)),
    "phi4-mini": ("Phi3ForCausalLM", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
        rope_parameters=None, rope_theta=10000.0, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
        max_position_embeddings=131072, sliding_window=262144, rms_norm_eps=1e-5,
        tie_word_embeddings=True)),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1e6,
        rope_parameters=None, max_position_embeddings=40960, rms_norm_eps=1e-6,
        num_experts=128, num_local_experts=None, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False)),
    "gpt-oss-20b": ("GptOssForCausalLM", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, rope_theta=150000, rope_parameters=None,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        layer_types=None, attention_bias=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
}  # fmt: skip


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_family_presets_are_what_the_released_config_json_reads_as(preset, tmp_path):
    arch, fields = RELEASED[preset]
    read = read_model_args(write_config(tmp_path, arch, **fields))
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert dataclasses.replace(read, **ids) == dataclasses.replace(B.PRESETS[preset].args, **ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_preset_streams_half_its_blocks_by_default_and_a_budget_that_streams_nothing_is_refused():
    result = B.run_bench(
        "1b", "cuda", torch.bfloat16, None,
        micro_batch_size=1, seq_len=256, micro_batches=2, steps=1, warmup=1,
    )  # fmt: skip
    streamed = result["modes"][0]
    assert streamed["fits"], streamed.get("reason")
    assert streamed["streamed_blocks"] >= streamed["blocks"] / 2
    assert streamed["h2d_bytes_per_step"] == streamed["streamed_bytes"] > 0
    assert "half the blocks" in result["gpu_memory_budget_kind"]
    with pytest.raises(ConfigError, match="--gpu-memory-budget.*keeps all 16 blocks resident"):
        B.run_bench(
            "1b", "cuda", torch.bfloat16, 60 * 2**30,
            micro_batch_size=1, seq_len=256, micro_batches=2, steps=1, warmup=0,
        )  # fmt: skip


def test_profile_adds_one_profiled_step_per_row(tmp_path, capsys):
    """--profile: each row profiles one more step; its operator table is printed and in the JSON
    (what a row that misses its floor is read with)."""
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", *SMALL]
    assert BC.main([*argv, "--profile", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["modes"]
    for row in rows:
        assert "Self CPU" in row["profile"] and "aten::" in row["profile"]
        assert f"{row['mode']}: one step under torch.profiler" in out
    assert len(rows[0]["losses"]) == 1  # the profiled step is not a timed one


def test_a_quantized_bench_says_what_dequantized_its_blocks(tmp_path):
    """With --base-quant the JSON names the dequantizer: "pytorch" on a CPU (on a GPU, "triton"
    unless its kernels did not load or launch), so a dequant share is read against the right one;
    and each row measures its dequantization (the figure issue 13 asks of the 70B NF4 row)."""
    from appliance.bench import step as bench

    assert bench._dequant_kernels("none", torch.device("cpu"), torch.float32) is None
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--base-quant", "nf4", "--steps", "1",
            "--warmup", "0", *SMALL, "--json", str(path)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert BC.main(argv) == 0
    result = json.loads(path.read_text())
    assert (result["base_quant"], result["dequant_kernels"]) == ("nf4", "pytorch")
    for row in result["modes"]:
        assert row["dequant_seconds_per_step"] > 0, row["mode"]
        assert 0 < row["dequant_share"] < 1, row["mode"]


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="torch.compile on a CPU needs a C++ compiler",
)
def test_compile_blocks_runs_the_engines_blocks_compiled_and_says_so(tmp_path, capsys):
    """--compile-blocks: the rows' blocks go through torch.compile (Dynamo compiles graphs), the
    JSON and the table say so, and the loss is the eager blocks' to fp32 rounding."""
    from torch._dynamo.utils import counters

    argv = ["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", *SMALL]
    argv += ["--modes", "streamed", "--micro-batches-per-step", "1"]
    eager, compiled = tmp_path / "eager.json", tmp_path / "compiled.json"
    assert BC.main([*argv, "--json", str(eager)]) == 0
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()  # static graphs, as a fresh process compiles (not another test's shapes)
    assert BC.main([*argv, "--compile-blocks", "--json", str(compiled)]) == 0
    assert counters["stats"]["unique_graphs"] > graphs
    assert "blocks compiled (torch.compile)" in capsys.readouterr().out
    e, c = json.loads(eager.read_text()), json.loads(compiled.read_text())
    assert (e["compile_blocks"], c["compile_blocks"]) == (False, True)
    (loss_e,), (loss_c,) = e["modes"][0]["losses"], c["modes"][0]["losses"]
    assert loss_c == pytest.approx(loss_e, rel=1e-5)


def test_the_full_finetune_row_counts_8nt_and_the_gradients_device_to_host():
    kw = dict(micro_batch_size=1, seq_len=32, micro_batches=2, steps=1, warmup=1)
    result = B.run_bench("tiny", "cpu", modes=("resident",), finetuning_type="full", **kw)
    row = result["modes"][0]
    assert result["finetuning_type"] == "full" and row["fits"]
    f = step_flops(B.PRESETS["tiny"].args, [(1, 32)] * 2, full=True, head_trained=True)
    assert row["flops_per_step"] == f.total  # 8·N·T and the head's weight gradient
    args = B.PRESETS["tiny"].args
    assert f.blocks == 8 * args.num_layers * block_param_count(args) * 64 and f.lora == 0
    f = row["full_finetune"]
    assert f["trained_parameters"] == param_count(B.PRESETS["tiny"].args)
    assert f["d2h_bytes_per_step"] == 4 * f["trained_parameters"]
    assert f["d2h_bytes_measured_per_step"] == 0  # a CPU copies nothing device→host
    assert f["optimizer_host_seconds_per_step"] > 0
    assert row["floor_seconds"] >= f["floor_d2h_seconds"]
    assert "full fine-tune, " in format_table(result)
    with pytest.raises(ConfigError, match="--finetuning-type full .* --base-quant none"):
        B.run_bench("tiny", "cpu", finetuning_type="full", base_quant="int8", **kw)
