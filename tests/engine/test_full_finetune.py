"""Full fine-tuning on the streamed step equals a plain full fine-tune (fp32, CPU).

The reference is transformers' model with `torch.optim.AdamW` over all its parameters, trained
with gradient accumulation over the same micro-batches (each micro-batch's summed NLL divided by
the global batch's target tokens, backward, accumulate), `clip_grad_norm_`, then the step: what
a plain full fine-tune with gradient accumulation does. docs/architecture.md ("Numerics that
must hold"): every step's loss to 1e-6 relative, every weight after the last step within 1e-6.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F

from appliance.engine.blocks import DictBlockSource
from appliance.engine.full import FullFinetuneEngine
from appliance.errors import ConfigError
from tests.helpers_model import batch, load_hf, make_model

LR, WD, CLIP = 1e-3, 0.01, 0.5
# AdamW moves a weight by lr·m/(√v + eps): near g = 0 its slope is lr/eps, times the fp32
# rounding of the gradient, which differs by ~1e-10 between the streamed blocks and
# transformers (their matmuls run on other shapes: seen up to 3e-8 on 0.1-sized gradients,
# equal bit for bit nowhere). At torch's default eps (1e-8) that was up to 2.2e-6 after one step,
# at eps 1e-6 1.1e-6 after three; eps 1e-5 in both optimizers: at most 2.2e-7 seen.
EPS = 1e-5


def reference_step(model, opt, micro_batches, clip) -> float:
    """One step of a plain full fine-tune with gradient accumulation; the global batch's loss."""
    n = sum(int((lab != -100).sum()) for _, lab in micro_batches)
    total = 0.0
    for ids, labels in micro_batches:
        logits = model(input_ids=ids).logits.float()
        part = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
            reduction="sum",
        ) / n  # fmt: skip
        part.backward()
        total += part.item()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return total


def step_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three micro-batches of 2 rows × 24 tokens (the windows and soft caps bite at 24)."""
    ids, labels = batch(6, 24, seed=20 + step)
    labels[1, 10:14] = -100  # uneven target counts: the normalisation must be global
    return [(ids[k : k + 2], labels[k : k + 2]) for k in (0, 2, 4)]


@pytest.mark.parametrize(
    "variant, clip, copy_blocks",
    [
        ("llama-mha", CLIP, False),
        ("qwen3-qknorm-tied", CLIP, False),
        ("gemma2-softcap-window", CLIP, False),
        # hybrid: Gated DeltaNet blocks beside gated full attention (their own weights)
        ("qwen3_5-hybrid", CLIP, False),
        # blocks copied into slots as on a GPU (block 0 kept across steps must be re-copied
        # after its update), and updates queued as each block's gradients land (no clipping)
        ("llama-gqa-rope3-tied", None, True),
    ],
)
def test_three_steps_equal_transformers_with_torch_adamw(variant, clip, copy_blocks, tmp_path):
    model_dir = make_model(tmp_path / "model", variant)
    ref = load_hf(model_dir).train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    engine = FullFinetuneEngine(
        DictBlockSource.from_hf(model_dir, torch.float32),
        weight_decay=WD,
        eps=EPS,
        grad_clip=clip,
        copy_blocks=copy_blocks,
    )
    before = {k: v.clone() for k, v in engine.named_weights().items()}
    ours, theirs, norms = [], [], []
    for step in range(3):
        stats = engine.train_step(step_batches(step), LR)
        ours.append(stats.loss)
        norms.append(stats.grad_norm)
        theirs.append(reference_step(ref, ref_opt, step_batches(step), clip))
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) / abs(b) < 1e-6, (ours, theirs)
    if clip:
        assert min(norms) > clip  # clipping was active at every step
    after = engine.named_weights()
    ref_weights = dict(ref.named_parameters())
    assert sorted(after) == sorted(ref_weights)  # every weight trains, none is missing
    for name, w in after.items():
        torch.testing.assert_close(w, ref_weights[name].detach(), rtol=0, atol=1e-6, msg=name)
        assert not torch.equal(w, before[name]), name  # and each one moved
    engine.close()


def test_frozen_embeddings_do_not_move_and_everything_else_does(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha")
    engine = FullFinetuneEngine(
        DictBlockSource.from_hf(model_dir, torch.float32), freeze_embeddings=True
    )
    before = {k: v.clone() for k, v in engine.named_weights().items()}
    engine.train_step(step_batches(0), LR)
    after = engine.named_weights()
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert all(not torch.equal(after[k], before[k]) for k in after if "embed" not in k)
    assert engine.host.num_parameters() == sum(
        v.numel() for k, v in before.items() if "embed" not in k
    )


def test_resumed_from_state_dict_the_next_step_is_bitwise_the_uninterrupted_one(tmp_path):
    model_dir = make_model(tmp_path / "model", "qwen3-qknorm-tied")

    def engine():
        return FullFinetuneEngine(DictBlockSource.from_hf(model_dir, torch.float32), grad_clip=CLIP)

    a = engine()
    a.train_step(step_batches(0), LR)
    saved = io.BytesIO()  # as a checkpoint holds it (state_dict's tensors are the live ones)
    torch.save(a.state_dict(), saved)
    b = engine()
    b.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert b.step_count == 1
    sa, sb = a.train_step(step_batches(1), LR), b.train_step(step_batches(1), LR)
    assert sa.loss == sb.loss
    wa, wb = a.named_weights(), b.named_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_another_models_optimizer_state_is_refused_in_one_line(tmp_path):
    small = make_model(tmp_path / "small", "llama-mha")
    other = make_model(tmp_path / "other", "llama-mha", intermediate_size=96)
    a = FullFinetuneEngine(DictBlockSource.from_hf(small, torch.float32))
    b = FullFinetuneEngine(DictBlockSource.from_hf(other, torch.float32))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight is shape .* another model's"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "variant, why",
    [("olmoe", "is a mixture of experts"), ("gemma4-ple-kv-shared", "is Gemma 4 (per-layer")],
)
def test_families_it_cannot_train_whole_are_refused_in_one_line(variant, why, tmp_path):
    source = DictBlockSource.from_hf(make_model(tmp_path / "model", variant), torch.float32)
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        FullFinetuneEngine(source)
    assert "\n" not in str(e.value) and "use --finetuning-type lora" in str(e.value)


def test_a_quantized_base_and_float16_are_refused_in_one_line(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha")
    with pytest.raises(ConfigError, match="quantized base .* --base-quant none"):
        FullFinetuneEngine(DictBlockSource.from_hf(model_dir, torch.float32, base_quant="int8"))
    with pytest.raises(ConfigError, match="float16 .* bfloat16 or float32"):
        FullFinetuneEngine(DictBlockSource.from_hf(model_dir, torch.float32), dtype=torch.float16)


def test_a_step_reports_the_optimizer_time_and_the_phases_partition_it(tmp_path):
    from appliance.metrics.recorders import TrainerMetrics

    model_dir = make_model(tmp_path / "model", "llama-mha")
    engine = FullFinetuneEngine(DictBlockSource.from_hf(model_dir, torch.float32))
    first = engine.train_step(step_batches(0), LR)
    stats = engine.train_step(step_batches(1), LR)  # waits for step 0's updates as it reads
    # a step reports the updates finished since the last one: step 0's may all finish after its
    # report (then they are in step 1's) or before, but by step 1's end every one has finished
    assert first.optimizer_host_seconds + stats.optimizer_host_seconds > 0
    assert stats.d2h_bytes == 0  # a CPU moves nothing
    assert stats.trained_parameters == engine.host.num_parameters()
    assert set(stats.phase_seconds) == {"forward", "backward", "h2d_stall", "h2d_host", "optimizer"}
    assert sum(stats.phase_seconds.values()) <= stats.step_seconds * 1.01
    TrainerMetrics(rank=0).record_step(stats.as_dict())  # every phase is a known one
