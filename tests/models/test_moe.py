"""Mixture-of-experts models (models/moe.py, qwen3_moe.py, olmoe.py): the streamed step equals
transformers + PEFT (fp32, 1e-5 relative), the load-balancing loss included, LoRA on the
attention (default) and on the experts (PEFT's target_parameters)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model_state_dict

from appliance import models
from appliance.adapter.export import export_merged
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from appliance.errors import ConfigError
from appliance.models import resolve_targets
from appliance.models.hf_checkpoint import read_model_args
from appliance.models.lora import LoraSpec, LoraWeights
from tests.engine.test_engine_parity import (
    RTOL,
    assert_gradients_match,
    assert_two_micro_batches_match,
)
from tests.helpers_model import (
    MOE_VARIANTS,
    batch,
    load_hf,
    lora_with_random_b,
    make_model,
    rel_err,
)

ATTENTION = LoraSpec(rank=4, alpha=8.0, targets=("q", "k", "v", "o"))
WITH_EXPERTS = LoraSpec(rank=2, alpha=4.0, targets=("q", "v", "experts"))


def moe_reference_loss(model, ids, labels) -> torch.Tensor:
    """transformers' loss: mean NLL plus router_aux_loss_coef × the load-balancing loss when
    config.json asks for the router logits."""
    out = model(input_ids=ids)
    logits = out.logits.float()
    nll = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    loss = nll / (labels != -100).sum()
    config = model.base_model.model.config if hasattr(model, "base_model") else model.config
    if config.output_router_logits:
        loss = loss + config.router_aux_loss_coef * out.aux_loss
    return loss


@pytest.mark.parametrize("variant", MOE_VARIANTS)
@pytest.mark.parametrize("spec", [ATTENTION, WITH_EXPERTS], ids=["attention", "experts"])
def test_moe_loss_and_every_lora_gradient_match_transformers_with_peft(variant, spec, tmp_path):
    model_dir = make_model(tmp_path / "model", variant, with_tokenizer=False)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, spec)
    lora.save(tmp_path / "adapter")
    ref = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter", is_trainable=True)
    assert_two_micro_batches_match(source, lora, ref, moe_reference_loss, seq_len=24)


def packed_rows(seed: int = 4) -> tuple[list, list]:
    """Two rows of 24 packed tokens (row 0: documents of 10 and 14 tokens, row 1: one of 24),
    as (ids, labels, (positions, segments)), and the documents alone as (ids, labels) rows."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 64, (n,), generator=g) for n in (10, 14, 24)]
    alone = []
    for d in docs:
        labels = torch.cat((d[1:], torch.tensor([-100])))  # no target crosses a document's end
        labels[:2] = -100
        alone.append((d[None], labels[None]))
    ids = torch.stack((torch.cat((docs[0], docs[1])), docs[2]))
    labels = torch.stack((torch.cat((alone[0][1][0], alone[1][1][0])), alone[2][1][0]))
    positions = torch.stack((torch.cat((torch.arange(10), torch.arange(14))), torch.arange(24)))
    segments = torch.stack((torch.tensor([0] * 10 + [1] * 14), torch.zeros(24, dtype=torch.long)))
    return [(ids, labels, (positions, segments))], alone


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_packed_documents_through_a_moe_model_equal_them_one_by_one(variant, tmp_path):
    """Packed documents (positions restart, attention within a document) through the MoE
    blocks equal each document alone through transformers + PEFT, experts adapted too. (The
    load-balancing loss is off: it is a statistic of the whole batch, not of each document.)"""
    model_dir = make_model(
        tmp_path / "model", variant, with_tokenizer=False, output_router_logits=False
    )
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, WITH_EXPERTS)
    lora.save(tmp_path / "adapter")
    ref = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter", is_trainable=True)
    assert_packed_rows_equal_them_alone(source, lora, ref, moe_reference_loss)


def assert_packed_rows_equal_them_alone(source, lora, ref, reference_loss) -> None:
    """packed_rows() through the streamed engine: its loss (a mean over every target token)
    and every LoRA gradient equal `ref`'s over each document alone, weighted by its targets."""
    packed, alone = packed_rows()
    loss, n_target, _ = StreamedEngine(source, lora, grad_clip=None).forward_backward(packed, 0)
    ref_loss = sum(reference_loss(ref, ids, lab) * (lab != -100).sum() for ids, lab in alone)
    ref_loss = ref_loss / n_target
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)


@pytest.mark.parametrize("variant", ["qwen3-moe", "gpt-oss"])
def test_a_trained_moe_adapter_loads_in_peft_and_its_export_gives_the_same_logits(
    variant, tmp_path
):
    """Train LoRA on the attention and experts (stored apart: Qwen3-MoE; fused: gpt-oss) → the
    adapter loads with PeftModel.from_pretrained (no key missing or unexpected) and gives the
    engine's logits → `appliance export` merges it, experts included, into a checkpoint plain
    transformers loads with the same logits."""
    model_dir = make_model(tmp_path / "model", variant)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = LoraWeights(source.args, WITH_EXPERTS)  # PEFT's initialisation: B = 0
    engine = StreamedEngine(source, lora)
    for step in range(2):
        ids, labels = batch(4, 16, seed=20 + step)
        engine.train_step([(ids[:2], labels[:2]), (ids[2:], labels[2:])], lr=5e-2)
    lora.save(tmp_path / "adapter")

    peft = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter").eval()
    result = peft.load_adapter(tmp_path / "adapter", adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    loaded = get_peft_model_state_dict(peft, adapter_name="again")
    assert sorted(loaded) == sorted(lora.peft_state_dict())
    ids, _ = batch(2, 24, seed=99)
    with torch.no_grad():
        theirs = peft(input_ids=ids).logits.float()
        base = load_hf(model_dir)(input_ids=ids).logits.float()
    assert rel_err(engine.logits(ids), theirs) < RTOL
    assert rel_err(base, theirs) > 1e-3  # the adapter moved

    out = export_merged(model_dir, tmp_path / "adapter", tmp_path / "merged")
    with torch.no_grad():
        merged = load_hf(out)(input_ids=ids).logits.float()
    assert rel_err(merged, theirs) < RTOL


def test_lora_on_the_experts_is_named_and_refused_with_dropout(tmp_path):
    model_dir = make_model(tmp_path / "model", "olmoe", with_tokenizer=False)
    args = read_model_args(model_dir)
    # the Llama defaults adapt a MoE block's attention; gate/up/down alone are not its modules
    assert resolve_targets(args, ("q", "k", "v", "o", "gate", "up", "down")) == ("q", "k", "v", "o")
    assert resolve_targets(args, ("v", "experts")) == ("v", "experts")
    with pytest.raises(ConfigError, match="--lora-targets gate: OlmoeForCausalLM has no such"):
        resolve_targets(args, ("q", "gate"))
    with pytest.raises(ConfigError, match="--lora-dropout 0.1: LoRA on the experts takes no"):
        LoraWeights(args, LoraSpec(rank=2, dropout=0.1, targets=("q", "experts")))


@pytest.mark.parametrize("variant, kind", [("qwen3-moe", "nf4"), ("mixtral", "int8")])
def test_a_quantized_moe_base_quantizes_every_expert_and_computes_with_its_dequantized_weights(
    variant, kind, tmp_path
):
    """--base-quant int8/nf4 on a MoE model: every expert's matrices are quantized (the
    router and norms are not), and the step equals the same step on the dequantized weights."""
    from appliance import quant

    model_dir = make_model(tmp_path / "model", variant, with_tokenizer=False)
    quantized = DictBlockSource.from_hf(model_dir, torch.float32, base_quant=kind)
    layout = models.expert_layout(quantized.args)
    block = quantized.block(0)
    experts = set(layout.expert_weights(quantized.args))
    assert {n for n, t in block.items() if isinstance(t, quant.QuantizedTensor)} == experts | {
        f"self_attn.{p}_proj.weight" for p in "qkvo"
    }
    plain = DictBlockSource(
        quantized.args,
        quantized.globals(),
        [
            {n: quant.dequantize(t, torch.float32) if isinstance(t, quant.QuantizedTensor) else t
             for n, t in quantized.block(i).items()}
            for i in range(quantized.num_blocks)
        ],
    )  # fmt: skip
    ids, labels = batch(2, 16, seed=6)
    losses = []
    for source in (quantized, plain):
        lora = lora_with_random_b(source.args, WITH_EXPERTS)
        losses.append(StreamedEngine(source, lora).forward_backward([(ids, labels)], 0)[0])
    assert losses[0] == losses[1]


def _moe_inputs(E=6, C=32, width=16, N=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(E, width, C, generator=g) / 6, torch.randn(E, width, C, generator=g) / 6
    down = torch.randn(E, C, width, generator=g) / 4
    x = torch.randn(N, C, generator=g)
    router = torch.randn(E, C, generator=g)
    return x, router, gate, up, down


def test_fused_experts_equal_the_same_experts_stored_apart_with_lora_on_them():
    """moe.FusedExperts (transformers v5's in-memory layout, gate_up (E, 2I, C); what Qwen3.5-MoE
    checkpoints store) and moe.SplitExperts (released Qwen3-MoE checkpoints) compute the same
    MoE output, LoRA on the experts included, and the same gradients for it."""
    from appliance.models import layers, moe

    E, r = 6, 2
    x, router, gate, up, down = _moe_inputs(E)
    split = {f"e.{j}.{n}": t[j] for j in range(E) for n, t in (("g", gate), ("u", up), ("d", down))}
    g = torch.Generator().manual_seed(1)
    A1, B1 = torch.randn(r * E, 32, generator=g), torch.randn(32, r * E, generator=g)
    A2, B2 = torch.randn(r * E, 16, generator=g), torch.randn(32, r * E, generator=g)
    results = []
    for fused in (True, False):
        params = [p.clone().requires_grad_(True) for p in (A1, B1, A2, B2)]
        lora = layers.LoraContext(
            {moe.GATE_UP: tuple(params[:2]), moe.DOWN: tuple(params[2:])}, 0.5
        )
        if fused:
            experts = moe.FusedExperts(torch.cat((gate, up), dim=1), down, lora)
        else:
            experts = moe.SplitExperts(split, ("e.{}.g", "e.{}.u", "e.{}.d"), E, lora)
        y, logits = moe.sparse_moe(x, router, experts, moe.Routing(2, renormalize=True))
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad for p in params])
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < RTOL  # (one fused matmul for gate and up, or two: rounding)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_grouped_gemm_equals_the_loop_over_experts_on_cuda():
    """On CUDA, bf16, fused experts without LoRA run as grouped GEMMs (torch._grouped_mm); they
    give the loop's output to bf16's rounding."""
    from appliance.models import moe

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this PyTorch has no torch._grouped_mm")
    x, router, gate, up, down = (t.cuda().bfloat16() for t in _moe_inputs(8, 64, 32, 300))
    experts = moe.FusedExperts(torch.cat((gate, up), dim=1), down)
    assert experts.grouped()
    routing = moe.Routing(2, renormalize=True)
    grouped, _ = moe.sparse_moe(x, router, experts, routing)
    weights, index = moe.route(torch.nn.functional.linear(x, router), routing)
    loop = torch.zeros_like(x)
    for j in range(8):
        rows, pos = torch.where(index == j)
        loop.index_add_(0, rows, experts.forward(j, x[rows]) * weights[rows, pos, None])
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)


def _skewed(source: DictBlockSource) -> DictBlockSource:
    """The router of every block made to send every token to experts 0–3 of 8: their rows are
    ±u and ±v, the others' zero, so the top 2 logits are |h·u| and |h·v| ≥ 0 and experts 4–7
    never receive a token."""
    g = torch.Generator().manual_seed(3)
    blocks = []
    for i in range(source.num_blocks):
        w = dict(source.block(i))
        u, v = torch.randn(2, source.args.hidden_size, generator=g)
        router = torch.zeros_like(w["block_sparse_moe.gate.weight"])
        router[:4] = torch.stack((u, -u, v, -v))
        w["block_sparse_moe.gate.weight"] = router
        blocks.append(w)
    return DictBlockSource(source.args, source.globals(), blocks)


def test_expert_granular_streaming_equals_whole_blocks_bit_for_bit_and_moves_only_routed_experts(
    tmp_path,
):
    """Streamed blocks copied into slots (the GPU path, here on a CPU): by expert, only the
    experts the step's tokens were routed to cross (forward: as routed; backward: prefetched
    from the forward's routing), and the loss and every LoRA gradient equal whole-block
    streaming bit for bit. With a router that leaves half the experts idle, fewer bytes move:
    exactly the dense parts and the routed experts, twice a step less the kept block."""
    model_dir = make_model(tmp_path / "model", "mixtral", with_tokenizer=False,
                           num_local_experts=8, output_router_logits=False)  # fmt: skip
    source = _skewed(DictBlockSource.from_hf(model_dir, torch.float32))
    args, L = source.args, source.args.num_layers
    ids, labels = batch(4, 16, seed=8)
    mbs = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    results = []
    for by_expert in (True, False):
        lora = lora_with_random_b(args, WITH_EXPERTS)
        engine = StreamedEngine(source, lora, copy_blocks=True, expert_streaming=by_expert)
        loss, _, _ = engine.forward_backward(mbs, 0)
        results.append((loss, [p.grad for p in lora.parameters()], engine.weights.take_timings()))
    (loss_e, grads_e, moved_e), (loss_w, grads_w, moved_w) = results
    assert loss_e == loss_w
    assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_w, strict=True))
    # bytes: whole blocks are 2L − 1 block copies; by expert, each copy is the dense part and
    # experts 0–3 (the forward copies the dense part ahead and the experts when routed to)
    layout = models.expert_layout(args)
    block = source.block(0)
    expert_bytes = sum(block[n].numel() * 4 for n in layout.expert_weights(args)) // 8
    whole = sum(t.numel() * 4 for t in block.values())
    assert moved_w["h2d_bytes"] == (2 * L - 1) * whole
    assert moved_e["h2d_bytes"] == (2 * L - 1) * (whole - 4 * expert_bytes)
    # the share of experts moved (step stats, bench, metrics): 4 of 8 in every copy
    assert moved_e["expert_share"] == 0.5 and moved_w["expert_share"] is None


def test_a_forward_prefetches_the_experts_its_previous_pass_routed_to(tmp_path):
    """The second pass of a block's forward finds the experts its first pass routed to already
    copied with the block (no on-demand copy: `expert_waits` 0), moves the same share of each
    block, and gives the same loss as whole-block streaming."""
    model_dir = make_model(tmp_path / "model", "mixtral", with_tokenizer=False,
                           num_local_experts=8, output_router_logits=False)  # fmt: skip
    source = _skewed(DictBlockSource.from_hf(model_dir, torch.float32))
    ids, labels = batch(4, 16, seed=8)
    mbs = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    losses, moved = [], []
    for by_expert in (True, False):
        engine = StreamedEngine(source, lora_with_random_b(source.args, WITH_EXPERTS),
                                copy_blocks=True, expert_streaming=by_expert)  # fmt: skip
        for _ in range(2):
            losses.append(engine.forward_backward(mbs, 0)[0])
            moved.append(engine.weights.take_timings())
    first, second = moved[:2]
    assert first["expert_waits"] > 0 and second["expert_waits"] == 0
    # the same share of each block copied as on the first pass (block 0 stays between passes)
    assert second["h2d_bytes"] * moved[2]["h2d_bytes"] == first["h2d_bytes"] * moved[3]["h2d_bytes"]
    assert second["expert_share"] == 0.5
    assert losses[0] == losses[1] == losses[2] == losses[3]
