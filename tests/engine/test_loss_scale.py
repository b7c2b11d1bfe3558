"""float16 compute: `--dtype auto` picks it on a GPU without bf16, and its steps scale the loss.

Everything runs on the CPU (torch's CPU kernels compute float16). What a GPU would answer is the
one thing mocked: torch.cuda.is_available / is_bf16_supported, for resolve_dtype.
"""

from __future__ import annotations

import copy
import io
import math
from itertools import pairwise

import pytest
import torch

from appliance.actors.trainer import resolve_device, resolve_dtype
from appliance.engine.blocks import DictBlockSource
from appliance.engine.loss_scale import LossScaler
from appliance.engine.step import StreamedEngine
from appliance.plan import doctor
from tests.helpers_model import batch, lora_with_random_b, make_model, rel_err

# ---------------------------------------------------------------- dtype auto


def a_gpu(monkeypatch, native_bf16: bool) -> None:
    """A visible GPU that computes bf16 natively (Ampere+) or only emulates it (a T4, a V100:
    torch.cuda.is_bf16_supported() is True there unless emulation is excluded)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: native_bf16 or including_emulation,
    )


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, "bfloat16"), (False, "float16")])
def test_dtype_auto_on_a_gpu_is_bf16_where_it_is_native_else_fp16(
    monkeypatch, native_bf16, expected
):
    a_gpu(monkeypatch, native_bf16)
    device = resolve_device("auto")
    assert device == "cuda"
    assert resolve_dtype("auto", device) == expected
    # doctor sizes and measures with the same answer (its advice follows it)
    assert doctor.auto_dtype(device) == getattr(torch, expected)
    assert resolve_dtype("auto", "cpu") == "float32"  # the CPU stays fp32 with a GPU beside it
    for explicit in ("float32", "bfloat16", "float16"):  # an explicit dtype is taken as given
        assert resolve_dtype(explicit, device) == explicit


def test_dtype_auto_without_a_gpu_is_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert doctor.auto_dtype("cpu") == torch.float32


# ---------------------------------------------------------------- the scaler's rules


def test_the_scale_halves_on_an_overflow_and_doubles_after_growth_interval_good_steps():
    s = LossScaler()
    assert s.scale == 2.0**16  # as torch.amp.GradScaler
    s = LossScaler(init_scale=1024.0, growth_interval=3)
    for finite, scale in [
        (True, 1024), (True, 1024), (True, 2048),  # 3 good steps in a row: doubled
        (True, 2048), (False, 1024),  # an overflow halves, and restarts the count
        (True, 1024), (True, 1024), (True, 2048),
    ]:  # fmt: skip
        s.update(finite)
        assert s.scale == scale
    with pytest.raises(ValueError):
        LossScaler(growth_interval=0)


# ---------------------------------------------------------------- the step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "model", "llama-mha")


_IDS, _LABELS = batch(4, 24)
MBS = [(_IDS[:2], _LABELS[:2]), (_IDS[2:], _LABELS[2:])]  # two micro-batches of two rows


def engine(model_dir, dtype=torch.float16, scaler=None, **kw) -> StreamedEngine:
    source = DictBlockSource.from_hf(model_dir, dtype)
    return StreamedEngine(source, lora_with_random_b(source.args), dtype=dtype,
                          loss_scaler=scaler, **kw)  # fmt: skip


def unscaled_grads(e: StreamedEngine) -> tuple[float, list[torch.Tensor]]:
    """(loss, every LoRA gradient, unscaled) of one forward + backward."""
    loss, _, _ = e.forward_backward(MBS, step=0)
    params = e.lora.parameters()
    if e.scaler is not None:
        e.scaler.unscale_(params)
    return loss, [p.grad for p in params]


def test_scaled_fp16_gradients_equal_unscaled_ones_and_are_close_to_fp32(model_dir):
    """Scaling by a power of two is exact in every multiplication and sum of the backward, unless
    a value leaves float16's range. So two scales that both keep every gradient normal give
    bit-identical unscaled gradients. Scale 1 does not: the smallest gradients (|g| below 2**-14,
    float16's smallest normal) lose bits as subnormals or flush to zero, which is why the loss is
    scaled; measured here: 1e-3 relative (2**0..2**12 differ, 2**13..2**19 are identical,
    2**20 overflows). Against fp32, float16's 11-bit mantissa leaves ~3.5e-3 relative."""
    losses, grads = {}, {}
    for k in (0, 14, 16):
        losses[k], grads[k] = unscaled_grads(engine(model_dir, scaler=LossScaler(2.0**k)))
    flat = {k: torch.cat([g.flatten() for g in v]) for k, v in grads.items()}
    assert torch.isfinite(flat[16]).all()
    assert torch.equal(flat[14], flat[16])  # bit for bit
    assert rel_err(flat[0], flat[16]) < 3e-3  # underflow at scale 1 only
    assert losses[0] == losses[14] == losses[16]  # the reported loss is never scaled

    loss32, grads32 = unscaled_grads(engine(model_dir, torch.float32))
    assert abs(losses[16] - loss32) / loss32 < 1e-3
    assert rel_err(flat[16], torch.cat([g.flatten() for g in grads32])) < 1e-2
    assert max(rel_err(a, b) for a, b in zip(grads[16], grads32, strict=True)) < 2e-2


def adam_state(e: StreamedEngine) -> dict:
    return copy.deepcopy(e.optimizer.state_dict()["state"])


def params(e: StreamedEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in e.lora.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same(list(a[k].values()), list(b[k].values())) for k in a)


def test_an_inf_gradient_skips_the_step_and_halves_the_scale_and_the_next_step_goes_on(
    model_dir, monkeypatch
):
    e = engine(model_dir, scaler=LossScaler(2.0**10, growth_interval=1000))
    first = e.train_step(MBS, lr=1e-2)
    assert (first.skipped_step, first.loss_scale, e.scaler.scale) == (False, 2.0**10, 2.0**10)
    before, state = params(e), adam_state(e)
    assert state  # AdamW has moments after the first step

    # an inf in one gradient, as an fp16 overflow in the backward leaves it: in block 1's
    # float16 gradient of one A, which the backward adds into the fp32 gradients
    # (models/lora_pass.py: hooks on the fp32 parameters themselves see no gradient)
    context = e.lora.context

    def overflowing(i, *args, **kw):
        ctx = context(i, *args, **kw)
        A, _ = next(iter(ctx.weights.values()))
        if i == 1 and A.requires_grad:  # the backward's pass (the forward's has no grad)
            A.register_hook(lambda g: torch.full_like(g, math.inf))
        return ctx

    monkeypatch.setattr(e.lora, "context", overflowing)
    skipped = e.train_step(MBS, lr=1e-2)
    monkeypatch.undo()
    assert skipped.skipped_step and not math.isfinite(skipped.grad_norm)
    assert math.isfinite(skipped.loss)  # the loss itself was fine
    assert skipped.loss_scale == 2.0**10 and e.scaler.scale == 2.0**9
    assert same(params(e), before)  # no update
    assert same_state(adam_state(e), state)  # not even AdamW's step count
    assert all(p.grad is None for p in e.lora.parameters())  # nothing carried into the next step
    assert e.step_count == 2  # the step happened (its batch is consumed), it just did not update

    after = e.train_step(MBS, lr=1e-2)
    assert not after.skipped_step and after.loss_scale == 2.0**9
    assert not same(params(e), before)
    assert int(e.optimizer.state_dict()["state"][0]["step"]) == 2


def test_a_scale_too_large_for_fp16_backs_off_until_steps_go_through_then_grows(model_dir):
    """2**24 overflows this model's float16 backward (2**20 already does): the engine skips and
    halves until the gradients fit, then doubles after `growth_interval` good steps."""
    e = engine(model_dir, scaler=LossScaler(2.0**24, growth_interval=2))
    start = params(e)
    history, losses = [], []
    for _ in range(20):
        stats = e.train_step(MBS, lr=1e-3)
        history.append((stats.loss_scale, stats.skipped_step))
        losses.append(stats.loss)
        if any(a < b for (a, _), (b, _) in pairwise(history)):
            break  # it probed upwards: every rule below has been exercised (no need for all 20)
        if not stats.skipped_step:
            continue
        if not any(not s for _, s in history):  # nothing has updated yet
            assert same(params(e), start) and not e.optimizer.state_dict()["state"]
    assert history[0] == (2.0**24, True)
    # every transition follows the rules: a skip halves, the 2nd good step in a row doubles
    good = 0
    for (scale, skipped), (next_scale, _) in pairwise(history):
        good = 0 if skipped else good + 1
        expected = scale / 2 if skipped else scale * 2 if good == 2 else scale
        good = 0 if good == 2 else good
        assert next_scale == expected, history
    # a skipped step left the adapter as it was: the next step's loss (same batch) is its loss
    for (_, skipped), (a, b) in zip(history[:-1], pairwise(losses), strict=True):
        assert not skipped or a == b
    grown = [a < b for (a, _), (b, _) in pairwise(history)]
    assert any(grown), history  # it probed upwards again
    assert not same(params(e), start)


# ---------------------------------------------------------------- checkpoints


def test_the_scale_goes_into_the_checkpoint_and_comes_back(model_dir):
    e = engine(model_dir, scaler=LossScaler(2.0**12, growth_interval=3))
    for _ in range(2):
        e.train_step(MBS, lr=1e-2)
    e.scaler.update(finite=False)  # 2**11, and the good-step count back to 0 ...
    e.scaler.update(finite=True)  # ... then 1
    buf = io.BytesIO()
    torch.save({"lora": e.lora.peft_state_dict(), **e.state_dict()}, buf)  # as Trainer does
    state = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True)

    resumed = engine(model_dir)  # a default scaler: 2**16, growth interval 2000
    resumed.lora.load_peft_state_dict(state["lora"], "checkpoint")
    resumed.load_state_dict(state)
    s = resumed.scaler
    assert (s.scale, s.good_steps, s.growth_interval) == (2.0**11, 1, 3)
    # and it trains on exactly as the original does, growing when the original grows
    scales = []
    for _ in range(3):
        a, b = e.train_step(MBS, lr=1e-2), resumed.train_step(MBS, lr=1e-2)
        assert (a.loss, a.loss_scale, a.skipped_step) == (b.loss, b.loss_scale, b.skipped_step)
        scales.append(b.loss_scale)
    assert scales == [2.0**11, 2.0**11, 2.0**12]
    assert same(params(e), params(resumed))


def test_a_checkpoint_without_a_scale_still_loads(model_dir):
    """Checkpoints written before float16 had a scaler (or by a bf16 run) have no loss_scale."""
    old = engine(model_dir, torch.float32)
    old.train_step(MBS, lr=1e-2)
    state = old.state_dict()
    assert "loss_scale" not in state
    e = engine(model_dir, scaler=LossScaler(2.0**8))
    e.load_state_dict(state)
    assert e.scaler.scale == 2.0**8 and e.step_count == 1


# ---------------------------------------------------------------- bf16 and fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_and_fp32_have_no_scaler(model_dir, dtype):
    e = engine(model_dir, dtype)
    assert e.scaler is None
    stats = e.train_step(MBS, lr=1e-2)
    assert stats.loss_scale is None and not stats.skipped_step
    assert "loss_scale" not in e.state_dict()
    with pytest.raises(ValueError, match="float16"):
        engine(model_dir, dtype, scaler=LossScaler())
