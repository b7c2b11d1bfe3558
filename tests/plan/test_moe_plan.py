"""The plan's bytes for a mixture of experts: the share of a streamed block's experts expected
to move at the run's tokens per block pass, 1 − (1 − k/E)^T under uniform routing
(plan/experts.py), checked exactly against the formula and loosely against an engine run."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from appliance.cli.main import main
from appliance.engine.blocks import DictBlockSource
from appliance.engine.memory import blocks_uploaded_per_step
from appliance.engine.step import StreamedEngine
from appliance.models.presets import PRESETS
from appliance.plan import experts
from appliance.plan.estimate import block_bytes, evaluate, plan_input
from tests.helpers_model import batch, lora_with_random_b, make_model
from tests.models.test_moe import WITH_EXPERTS
from tests.plan.test_doctor import doctor_here


def test_the_plan_moves_the_expected_share_of_experts_by_the_formula():
    """qwen3-30b-a3b at 16 tokens a step: 1 − (1 − 8/128)^16 of each streamed block's experts
    (128 × 3 matrices of 2048 × 768 in bf16) cross; at 2048 tokens, all; gpt-oss's fused experts
    and an NF4 base cross whole."""
    args = PRESETS["qwen3-30b-a3b"].args
    p = plan_input(None, "qwen3-30b-a3b", "4090", "2", None, seq_len=8, micro_batch_size=1)
    r = evaluate(p, 2)
    share = 1 - (1 - 8 / 128) ** 16
    assert r["moe"]["expected_share"] == share and r["moe"]["streamed_by_expert"]
    experts_bytes = 128 * 3 * 2048 * 768 * 2
    assert experts.expert_block_bytes(args, 2) == experts_bytes
    uploads = blocks_uploaded_per_step(args.num_layers, r["resident_blocks"])
    whole = block_bytes(args, 2)
    per_copy = (1 - (1 - share) ** 2 + share) / 2  # forwards hold the previous step's too
    assert r["moe"]["expected_share_per_copy"] == per_copy
    moved = whole - round((1 - per_copy) * experts_bytes)
    assert r["streamed_bytes_per_step"] == uploads * moved < uploads * whole

    big = evaluate(plan_input(None, "qwen3-30b-a3b", "4090", "1", None, seq_len=2048), 1)
    assert big["moe"]["expected_share"] == 1 - (1 - 8 / 128) ** 2048 > 1 - 1e-12
    for preset, quant in (("gpt-oss-20b", "none"), ("qwen3-30b-a3b", "nf4")):
        q = plan_input(None, preset, "h100", "1", None, seq_len=8, base_quant=quant)
        r = evaluate(q, 1)
        assert r["moe"]["expected_share"] == 1.0 and not r["moe"]["streamed_by_expert"]
        uploads = blocks_uploaded_per_step(q.args.num_layers, r["resident_blocks"])
        assert r["streamed_bytes_per_step"] == uploads * block_bytes(q.args, 2, quant)
    dense = evaluate(plan_input(None, "qwen3-8b", "4090", "1", None, seq_len=8), 1)
    assert "moe" not in dense


def _uniform(source: DictBlockSource, seed: int = 5) -> DictBlockSource:
    """Every block's router drawn at random (unit normal): tokens spread over the experts."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for i in range(source.num_blocks):
        w = dict(source.block(i))
        name = "block_sparse_moe.gate.weight"
        w[name] = torch.randn(w[name].shape, generator=g)
        blocks.append(w)
    return DictBlockSource(source.args, source.globals(), blocks)


def test_the_engine_moves_about_the_planned_share_with_a_uniform_router(tmp_path):
    """A streamed step of 12 tokens over a tiny Mixtral (top 2 of 16, random routers): the share
    of experts the engine copied (StepStats.expert_share) is at most about 1 − (14/16)^12 ≈
    0.80, the uniform, independent routing the plan assumes (the most experts T tokens can be
    expected to reach), and well above one token's k/E. (Measured 0.55–0.68 over five seeds:
    a model's tokens share directions, so they route alike more often than independent draws.)"""
    model_dir = make_model(tmp_path / "model", "mixtral", with_tokenizer=False,
                           num_local_experts=16, output_router_logits=False)  # fmt: skip
    source = _uniform(DictBlockSource.from_hf(model_dir, torch.float32))
    engine = StreamedEngine(source, lora_with_random_b(source.args, WITH_EXPERTS),
                            copy_blocks=True)  # fmt: skip
    ids, labels = batch(2, 6, seed=4)
    stats = engine.train_step([(ids[:1], labels[:1]), (ids[1:], labels[1:])], lr=1e-3)
    expected = experts.expected_share(12, 2, 16)
    assert abs(expected - 0.8) < 0.01
    assert 2 * 2 / 16 < stats.expert_share <= expected + 0.05


def test_doctor_says_the_active_parameters_and_the_experts_expected_to_move():
    """`appliance doctor --preset qwen3-30b-a3b --tokens-per-step 16`: the blocks' active
    parameters against all of them, and 1 − (1 − 8/128)^16 of the experts expected to cross;
    gpt-oss's fused experts cross whole; a bad --tokens-per-step is one line naming it."""
    _, checks = doctor_here("--preset", "qwen3-30b-a3b", "--device", "cpu",
                            "--tokens-per-step", "16")  # fmt: skip
    c = checks["moe"]
    assert c["status"] == "ok"
    assert c["detail"].startswith(
        "mixture of experts, top 8 of 128: a token meets 2.73B of the blocks' 29.9B parameters "
        "(30.5B with the embeddings and head); at 16 tokens a step, 64.4% of each streamed "
        "block's experts expected to cross"
    )
    assert f"{1 - (1 - 8 / 128) ** 16:.1%}" == "64.4%"
    args = PRESETS["gpt-oss-20b"].args
    assert experts.doctor_line(args, "none", 16).endswith("streamed blocks cross whole "
                                                         "(experts fused in one tensor, or "
                                                         "quantized)")  # fmt: skip
    out = CliRunner().invoke(main, ["doctor", "--preset", "tiny", "--tokens-per-step", "0"])
    assert out.exit_code != 0 and "--tokens-per-step must be ≥ 1 (got 0)" in out.output
