"""The two tiers of block kernels (docs/architecture.md, "Two tiers of kernels").

exact: a block's LoRA weights gathered in one copy per pass and its gradients added back in one
add per micro-batch (models/lora_pass.py), bit for bit the per-module casts (and so PEFT: the
parity suite). fast: the shared-input A's in one matmul, held to the rule in kernel_rule.py on
every family's tiny variant, per block and per step, and deterministic.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from appliance import models
from appliance.engine.blocks import DictBlockSource
from appliance.models import layers, rope
from appliance.models.lora import folds_scale
from tests.engine import kernel_rule
from tests.helpers_model import SPEC, batch, lora_with_random_b, make_model


def per_module_context(lora, i: int, dtype: torch.dtype) -> layers.LoraContext:
    """The LoRA context as it was made before the flat buffers: a differentiable cast of each
    A and B, the power-of-two scale folded into B by a multiply per module."""
    fold = folds_scale(lora.spec.scale, dtype)
    weights = {}
    for m, (A, B) in lora.blocks[i].items():
        B16 = B.to(dtype)
        weights[m] = (A.to(dtype), torch.ops.aten.mul.Scalar(B16, lora.spec.scale) if fold else B16)
    return layers.LoraContext(weights, 1.0 if fold else lora.spec.scale, lora.spec.dropout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "variant, spec",
    [
        ("llama-gqa-rope3-tied", dataclasses.replace(SPEC, dropout=0.1)),  # scale 2: folded
        ("phi3-partial-longrope", dataclasses.replace(SPEC, alpha=6.0)),  # 1.5: multiplied
    ],
)
def test_one_gather_and_one_add_equal_the_per_module_casts_bit_for_bit(
    variant, spec, dtype, tmp_path
):
    """Two micro-batches through one block: the output, the input gradient and every LoRA
    gradient (the second micro-batch's added to the first's) are the per-module path's."""
    source = DictBlockSource.from_hf(make_model(tmp_path / "model", variant), dtype)
    args, w = source.args, source.block(1)
    lora = lora_with_random_b(args, spec)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(1, 20, args.hidden_size, generator=g).to(dtype) for _ in range(2)]
    go = [torch.randn(1, 20, args.hidden_size, generator=g).to(dtype) for _ in range(2)]
    cos, sin = rope.rope_cos_sin(args, 20, torch.device("cpu"), dtype)
    results = []
    for gathered in (True, False):
        ctx = lora.context(1, dtype) if gathered else per_module_context(lora, 1, dtype)
        out = []
        for m in range(2):
            ctx.generator = torch.Generator().manual_seed(5 + m)  # the same masks both ways
            x = xs[m].clone().requires_grad_(True)
            y = models.block_forward(x, w, args, cos, sin, ctx, layer=1)
            y.backward(go[m])
            out += [y.detach(), x.grad]
        params = [p for ab in lora.blocks[1].values() for p in ab]
        results.append(out + [p.grad.clone() if p.grad is not None else None for p in params])
        for p in params:
            p.grad = None
    gathered, per_module = results
    assert all(
        a is not None and torch.equal(a, b) for a, b in zip(gathered, per_module, strict=True)
    )


def one_llama_block() -> layers.ModelArgs:
    return layers.ModelArgs(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=64, architecture="LlamaForCausalLM",
    )  # fmt: skip


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_a_micro_batch_adds_its_lora_gradients_in_one_add():
    """The backward of a block's LoRA weights, per micro-batch: one concatenation, one multiply
    (the folded scale) and one add into fp32 (the first micro-batch copies); no cast per module.
    The parameters' gradients are views of the block's one fp32 gradient buffer."""
    args = one_llama_block()
    lora = lora_with_random_b(args, dataclasses.replace(SPEC, alpha=8.0))  # scale 2: folded
    ctx = lora.context(0, torch.bfloat16)
    xs = {n: torch.randn(6, n, dtype=torch.bfloat16) for n in (32, 64)}  # down_proj: 64 wide
    counted = []
    for _ in range(2):
        y = sum(F.linear(F.linear(xs[A.shape[1]], A), B).sum() for A, B in ctx.weights.values())
        with _Ops() as ops:
            y.backward()
        counted.append([n.split(".")[0] for n in ops.names])
    first, second = counted
    assert "aten::_to_copy" not in first + second  # no cast back per module
    assert second.count("aten::add_") == 1 and second.count("aten::cat") == 1
    assert second.count("aten::mul_") == 1 and first.count("aten::copy_") == 1
    buffer = lora.buffers[0].grad
    assert all(p.grad.untyped_storage().data_ptr() == buffer.data_ptr() for p in lora.parameters())


def test_a_projection_that_did_not_run_keeps_no_gradient():
    """A micro-batch whose block ran only some of its adapted projections: the others' A and B
    keep `.grad` None (as PEFT's do, so AdamW leaves them alone), the rest are summed."""
    args = one_llama_block()
    lora = lora_with_random_b(args)
    x = torch.randn(6, 32)
    ctx = lora.context(0, torch.float32)
    for _ in range(2):
        A, B = ctx.weights["self_attn.q_proj"]
        F.linear(F.linear(x, A), B).sum().backward()
    q = lora.blocks[0]["self_attn.q_proj"]
    A, B = q
    expected_a = 2 * torch.autograd.grad(F.linear(F.linear(x, A), B * lora.spec.scale).sum(), A)[0]
    assert torch.allclose(A.grad, expected_a)
    others = [p for m, ab in lora.blocks[0].items() if m != "self_attn.q_proj" for p in ab]
    assert all(p.grad is None for p in others)


# one tiny variant per family (appliance/models/): the block's numbers differ between them
FAMILIES = [
    "llama-gqa-rope3-tied",
    "qwen3-qknorm-tied",
    "gemma2-softcap-window",
    "gemma3-local-rope",
    "phi3-partial-longrope",
    "mistral3-vlm",
    "qwen3-moe",
    "gpt-oss",
    "qwen3_5-hybrid",
    "qwen3_5-moe",
    "qwen2-moe",
    "gemma4-moe",
]


@pytest.mark.parametrize("variant", FAMILIES)
def test_the_fast_kernels_keep_the_rule_per_block_and_per_step(variant, tmp_path):
    """Per block (each kind of layer the variant has): output, input gradient and each LoRA
    gradient within 3× exact bf16's error from fp64; per step: loss within 1e-3, gradient norm
    within 1%; the fast step twice gives the same numbers."""
    model_dir = make_model(tmp_path / "model", variant)
    source = DictBlockSource.from_hf(model_dir, torch.bfloat16)
    args = source.args
    lora = lora_with_random_b(args)
    kinds = sorted({models.first_layer_like(args, i) for i in range(args.num_layers)})
    for layer in kinds:
        exact, fast = kernel_rule.block_errors(args, source.block(layer), lora, layer)
        kernel_rule.assert_block_within_rule(exact, fast)
    ids, labels = batch(4, 16, seed=2)
    mbs = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    step = dict(source=source, make_lora=lambda: lora_with_random_b(args), micro_batches=mbs)
    exact = kernel_rule.step_results(**step, kernels="exact")
    fast = kernel_rule.step_results(**step, kernels="fast")
    kernel_rule.assert_step_within_rule(exact, fast)
    again = kernel_rule.step_results(**step, kernels="fast")
    assert fast[0] == again[0]
    assert all(torch.equal(a, b) for a, b in zip(fast[2], again[2], strict=True))


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")),
    reason="torch.compile on a CPU needs a C++ compiler",
)
def test_compiled_blocks_keep_the_rule(tmp_path):
    """The other fast piece, torch.compile of the block (Inductor's fused kernels), per block
    (slow: the compiles)."""
    source = DictBlockSource.from_hf(
        make_model(tmp_path / "m", "llama-gqa-rope3-tied"), torch.bfloat16
    )
    lora = lora_with_random_b(source.args)
    torch._dynamo.reset()
    exact, fast = kernel_rule.block_errors(
        source.args, source.block(0), lora, 0, block=models.compiled_block_forward
    )
    kernel_rule.assert_block_within_rule(exact, fast)
    assert fast != exact  # Inductor's kernels ran: they round differently


def test_gemma4_s_step_keeps_the_rule(tmp_path):
    """Gemma 4 (per-layer inputs, blocks that reuse another's K/V: a state across blocks) by
    the step's part of the rule, and run to run."""
    source = DictBlockSource.from_hf(
        make_model(tmp_path / "m", "gemma4-ple-kv-shared"), torch.bfloat16
    )
    ids, labels = batch(4, 16, seed=2)
    mbs = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    step = dict(source=source, make_lora=lambda: lora_with_random_b(source.args), micro_batches=mbs)
    fast = kernel_rule.step_results(**step, kernels="fast")
    kernel_rule.assert_step_within_rule(kernel_rule.step_results(**step, kernels="exact"), fast)
    assert fast[0] == kernel_rule.step_results(**step, kernels="fast")[0]


def test_the_fast_kernels_stack_the_shared_input_a_s_without_a_copy():
    """`kernels="fast"`: q, k, v's A's are one (3r, in) tensor, gate and up's one (2r, in),
    views of the pass's one cast buffer; with LoRA dropout (a mask per projection) there is no
    stack."""
    args = one_llama_block()
    lora = lora_with_random_b(args)
    ctx = lora.context(0, torch.bfloat16, kernels="fast")
    qkv, j = ctx.stacked["self_attn.k_proj"]
    assert qkv.shape == (3 * SPEC.rank, 32) and j == 1
    assert ctx.stacked["mlp.up_proj"][0].shape == (2 * SPEC.rank, 32)
    A_k = ctx.weights["self_attn.k_proj"][0]
    assert A_k.data_ptr() == qkv.data_ptr() + SPEC.rank * 32 * 2  # a view, in bf16
    assert set(ctx.stacked) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                "mlp.gate_proj", "mlp.up_proj"}  # fmt: skip
    dropped = lora_with_random_b(args, dataclasses.replace(SPEC, dropout=0.1))
    assert dropped.context(0, torch.bfloat16, kernels="fast").stacked is None


def test_the_tier_is_a_flag_resolved_in_one_place_and_named_by_the_card(tmp_path):
    """--kernels (a config key too) takes exact | fast | auto, anything else is refused naming
    the flag; auto is exact on both devices until a GPU measures fast faster; compiled blocks
    are the fast tier; the model card says which tier a run used."""
    from appliance.actors.trainer import resolve_kernels
    from appliance.adapter import model_card
    from appliance.config import build_config
    from appliance.errors import ConfigError

    assert build_config({}, {"kernels": "fast"}).kernels == "fast"
    assert build_config({}, {}).kernels == "auto"
    with pytest.raises(ConfigError, match=r"--kernels must be one of auto \| exact \| fast"):
        build_config({}, {"kernels": "fastest"})
    assert [resolve_kernels("auto", d) for d in ("cpu", "cuda")] == ["exact", "exact"]
    assert resolve_kernels("fast", "cpu") == "fast"
    assert resolve_kernels("exact", "cuda", compile_blocks=True) == "fast"
    cfg = build_config({}, {"model": "/m", "data": str(tmp_path / "d.jsonl"), "output": "/o"})
    record = {"config": cfg.to_dict(), "steps": 1, "dtype": "bfloat16", "device": "cuda"}
    rows = dict(
        model_card.training_rows({**record, "kernels": "fast"}, model_card.BaseModel("/m"), {})
    )
    assert rows["precision"].startswith("bfloat16 on cuda, fast kernels")
    rows = dict(
        model_card.training_rows({**record, "kernels": "exact"}, model_card.BaseModel("/m"), {})
    )
    assert "exact kernels (bitwise transformers + PEFT)" in rows["precision"]
