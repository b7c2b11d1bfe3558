"""The GPU path's bookkeeping, run on a CPU: blocks copied through two streaming slots, resident
blocks in their own buffers, saved inputs offloaded and brought back through two slots.

`StreamedEngine(copy_blocks=True)` makes DeviceWeights copy each block's flat host buffer to the
"device" exactly as on CUDA, with no streams or events (a CPU's copies are done when they return),
and `SavedInputs.allocate` does the same for the saved inputs. So these tests check what the CUDA
tests can only check with a GPU: that the engine never needs a third slot, releases what it
holds (also after a step that raised), keeps block 0 between steps, copies the bytes the planner
counts, and that copying changes no number: every loss and gradient equals reading in place,
bit for bit. What only CUDA has (streams, events, page-locking) is tests/engine/test_engine_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

from appliance.bench.synthetic import SyntheticBlockSource
from appliance.engine.batches import MicroBatch, batch_sizes
from appliance.engine.memory import blocks_uploaded_per_step
from appliance.engine.step import StreamedEngine
from appliance.models.presets import _llama
from tests.helpers_model import lora_with_random_b

ARGS = _llama(512, 64, 160, 6, 4, 2)  # six blocks
L = ARGS.num_layers


def micro_batches(n: int = 3, rows: int = 2, T: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, ARGS.vocab_size, (rows, T + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[:, :3] = -100
        out.append((ids[:, :-1].contiguous(), labels))
    return out


def grads(engine):
    return [p.grad.clone() for p in engine.lora.parameters()]


def engines(base_quant: str = "none", resident: frozenset = frozenset()):
    """(reading in place, copying through slots) over the same weights and LoRA start."""
    source = SyntheticBlockSource(ARGS, torch.float32, base_quant=base_quant)
    ref = StreamedEngine(source, lora_with_random_b(ARGS), grad_clip=None)
    eng = StreamedEngine(source, lora_with_random_b(ARGS), grad_clip=None, copy_blocks=True)
    eng.weights.configure(set(resident), slots=2)
    return source, ref, eng


def same_step(ref, eng, mbs, step: int) -> None:
    """One forward/backward and AdamW step of both engines: the same loss and LoRA gradients,
    bit for bit."""
    loss_r, _, _ = ref.forward_backward(mbs, step)
    loss_c, _, _ = eng.forward_backward(mbs, step)
    assert loss_c == loss_r
    assert all(torch.equal(a, b) for a, b in zip(grads(eng), grads(ref), strict=True))
    ref.optimizer_step(lr=1e-2)
    eng.optimizer_step(lr=1e-2)


def in_slots(engine, tensors) -> bool:
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in engine.weights._slots]
    return all(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors)


@pytest.mark.parametrize("base_quant", ["none", "nf4"])
@pytest.mark.parametrize("resident", [frozenset(), frozenset({4, 5})], ids=["none", "last2"])
def test_blocks_copied_through_two_slots_equal_blocks_read_in_place(base_quant, resident):
    source, ref, eng = engines(base_quant, resident)
    mbs = micro_batches()
    flat = source.flat_block(0)[0].nbytes
    for step in range(2):  # the first step, then the steady state (a third repeats the second)
        same_step(ref, eng, mbs, step)
        copied = eng.weights.take_timings()["h2d_bytes"]
        if step > 0:  # steady state: what the planner counts (block 0 stayed from the last step)
            assert copied == blocks_uploaded_per_step(L, len(resident)) * flat
        # between steps only block 0 (the next forward's first) and the resident blocks stay
        assert set(eng.weights._on_device) == {0} | resident
        assert len(eng.weights._slots) == 2 and len(eng.weights._free_slots) == 1
    # an eval and a logits call between steps see the same weights, and give the slots back
    assert eng.eval_loss(mbs) == ref.eval_loss(mbs)
    assert torch.equal(eng.logits(mbs[0][0]), ref.logits(mbs[0][0]))
    assert set(eng.weights._on_device) == set(resident)
    w = eng.weights.get(1)
    if base_quant == "none":  # a streamed block's weights are views of a slot, not new memory
        assert in_slots(eng, w.values())
    eng.weights.release(1)
    assert len(eng.weights._free_slots) == 2


def test_a_third_slot_is_never_needed_and_asking_for_one_says_so():
    _, _, eng = engines()
    eng.weights.prefetch(0)
    eng.weights.prefetch(1)
    with pytest.raises(RuntimeError, match=r"block 2: no free streaming slot \(blocks \[0, 1\]"):
        eng.weights.prefetch(2)
    eng.weights.release(0)
    eng.weights.prefetch(2)  # the freed slot takes it
    assert sorted(eng.weights._on_device) == [1, 2]


def test_a_step_that_raised_midway_leaves_no_slot_taken(monkeypatch):
    """An exception in the middle of the forward (block 3) leaves blocks in the slots; the next
    step starts by releasing them and equals a step of an engine that never failed."""
    _, ref, eng = engines()
    mbs = micro_batches()
    real = eng._block  # the engine's block function (models.block_forward)
    calls = iter(range(10**6))

    def failing(*args, layer, **kw):
        if layer == 3 and next(calls) == 0:
            raise RuntimeError("injected")
        return real(*args, layer=layer, **kw)

    monkeypatch.setattr(eng, "_block", failing)
    with pytest.raises(RuntimeError, match="injected"):
        eng.forward_backward(mbs, 0)
    assert len(eng.weights._free_slots) == 0  # blocks 3 and 4 were left in the slots
    loss_c, _, _ = eng.forward_backward(mbs, 0)
    loss_r, _, _ = ref.forward_backward(mbs, 0)
    assert loss_c == loss_r
    assert all(torch.equal(a, b) for a, b in zip(grads(eng), grads(ref), strict=True))


def test_offloaded_saved_inputs_equal_inputs_kept_in_place():
    """Saved inputs copied into one host buffer laid out at plan time and brought back, block
    i−1's while block i computes, through two slots: the same step, bit for bit."""
    _, ref, eng = engines()
    mbs = micro_batches()
    eng.saved.allocate(sum(ids.numel() for ids, _ in mbs), ARGS.hidden_size, torch.float32)
    tokens = sum(ids.numel() for ids, _ in mbs)
    for step in range(2):
        same_step(ref, eng, mbs, step)
        assert eng.saved._loaded == {}  # every slot given back
        # every block's inputs came back once (fp32), but the last block's, which the backward
        # takes from the device slot it was kept in: what the bench reports beside W
        assert eng.saved.take_h2d_bytes() == (L - 1) * tokens * ARGS.hidden_size * 4
    stats = eng.train_step(mbs, lr=1e-2)
    assert stats.offload_h2d_bytes == (L - 1) * tokens * ARGS.hidden_size * 4
    bigger = micro_batches(n=4)
    with pytest.raises(RuntimeError, match="saved inputs: this step has .* the plan allocated"):
        eng.forward_backward(bigger, 2)


def test_a_batch_bigger_than_the_plan_holds_is_planned_again(monkeypatch):
    """The demo evaluates before it trains: the plan made for the eval's batch (smaller, nothing
    saved) is made again for the first training step's, sized for the biggest of each size seen;
    a batch the plan holds plans nothing. (On CUDA the plan then allocates what the bigger batch
    needs: the offload's host buffer, tests/engine/test_engine_gpu.py.)"""
    _, _, eng = engines()
    planned = []
    plan = eng.plan
    monkeypatch.setattr(eng, "plan", lambda mbs: (planned.append(batch_sizes(mbs)), plan(mbs)))
    small, big = micro_batches(n=1), micro_batches(n=4)
    longer = micro_batches(n=1, rows=1, T=48)  # fewer tokens than `big`, a longer sequence
    eng.eval_loss(small)
    eng.forward_backward(big, 0)
    eng.forward_backward(big, 1)
    eng.eval_loss(small)
    assert planned == [batch_sizes(small), batch_sizes(big)]
    eng.eval_loss(longer)
    assert planned[2:] == [batch_sizes(longer)]
    # the most tokens of `big`; the biggest micro-batch (48 tokens) and longest row of `longer`
    assert eng._sized_for == {"tokens": 4 * 2 * 16, "biggest": 48, "longest": 48}


def test_the_plan_counts_the_packed_documents_masks_a_pass_keeps():
    """Packed micro-batches carry a layout (positions, segments): a pass keeps a boolean
    (B, 1, T, T) document mask for each (on a CPU; on CUDA a Llama block takes a small BlockMask
    instead), and the plan counts them; unpacked micro-batches have none."""
    _, _, eng = engines()
    plain = micro_batches(n=3, rows=2, T=16)
    segments = torch.arange(16).div(6, rounding_mode="floor").expand(2, 16)  # 3 documents a row
    positions = torch.arange(16).remainder(6).expand(2, 16)
    packed = [(ids, labels, (positions, segments)) for ids, labels in plain]
    extra = eng.plan_inputs(packed)["globals_bytes"] - eng.plan_inputs(plain)["globals_bytes"]
    assert extra == 3 * 2 * 16 * 16
    mask = eng._attention_inputs(MicroBatch(*packed[0]))[1]
    assert mask.dtype == torch.bool and mask.numel() * mask.element_size() == 2 * 16 * 16


def test_a_copy_interrupted_before_it_is_queued_leaves_its_slot_free(monkeypatch):
    """Ctrl-C in the staging wait (or any error before the copy is queued): the slot it took goes
    back, so the next prefetch still finds two."""
    _, _, eng = engines()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eng.weights, "_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.weights.prefetch(1)
    assert len(eng.weights._free_slots) == 2 and 1 not in eng.weights._on_device
    monkeypatch.undo()
    eng.weights.prefetch(1)
    assert 1 in eng.weights._on_device


def test_a_bare_cuda_device_gets_the_current_devices_index(monkeypatch):
    """torch.cuda.set_per_process_memory_fraction (the engine's budget cap) refuses a CUDA device
    without an index; the engine and the bench take "cuda" as the current device, with its
    index. (No GPU here: current_device is the only thing mocked.)"""
    from torch.cuda._utils import _get_device_index

    from appliance.engine.device_weights import with_index

    with pytest.raises(ValueError, match="specified index"):
        _get_device_index(torch.device("cuda"))  # what a bare "cuda" would meet
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert with_index(torch.device("cuda")) == torch.device("cuda", 1)
    assert _get_device_index(with_index(torch.device("cuda"))) == 1
    assert with_index(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert with_index(torch.device("cpu")) == torch.device("cpu")


def test_resident_blocks_get_their_buffers_when_configured_and_a_replan_frees_old_slots():
    """configure allocates each resident block's own buffer with the slots (not between the
    first step's activations); a second configure that makes a block resident which was in a
    slot drops that copy with the old slots, and the block comes back into its own buffer."""
    source, ref, eng = engines(resident=frozenset({4, 5}))
    w = eng.weights
    assert sorted(w._resident_buffers) == [4, 5]
    planned = {i: t.data_ptr() for i, t in w._resident_buffers.items()}
    size = source.flat_block(5)[0].nbytes
    w.prefetch(5)
    assert all(planned[5] <= t.data_ptr() < planned[5] + size for t in w.get(5).values())
    assert sorted(w._resident_buffers) == [4]
    w.release(5)  # a resident block stays
    w.prefetch(1)  # streamed: in a slot
    w.configure({1, 5}, slots=2)  # a second plan: block 1 is resident now
    assert sorted(w._on_device) == [5]  # the old slot's copy of block 1 is gone
    assert sorted(w._resident_buffers) == [1]
    w.prefetch(1)
    assert not in_slots(eng, w.get(1).values())
    got, want = w.get(1), source.block(1)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    same_step(ref, eng, micro_batches(), 0)  # and the engine still computes the same step


def test_host_memory_registered_by_an_object_dropped_without_close_is_unregistered(monkeypatch):
    """DeviceWeights and SavedInputs page-lock host memory in place; if one is dropped without
    close() (an exception on the way out of a trainer or a test), its registrations are undone
    all the same, once: a freed range left registered would make a later allocation at the same
    address look pinned. (No GPU here: the addresses are made up and host_unregister records
    them instead of calling CUDA.)"""
    import gc

    from appliance.engine import cuda_host

    undone = []
    monkeypatch.setattr(cuda_host, "host_unregister", undone.append)
    _, _, eng = engines()
    eng.weights._registered.extend([0x1000, 0x2000])
    eng.saved._registered.append(0x3000)
    eng.weights.close()  # closed: unregistered now, and not again when collected
    assert undone == [0x1000, 0x2000]
    eng.weights._registered.append(0x4000)  # (as if registered after)
    del eng
    gc.collect()
    assert sorted(undone) == [0x1000, 0x2000, 0x3000, 0x4000]


def test_closing_the_saved_inputs_drops_the_views_of_their_host_buffer():
    """A second plan (allocate → close) must not keep the first plan's host buffer alive
    through the last step's saved views until the next step starts."""
    _, _, eng = engines()
    mbs = micro_batches()
    eng.saved.allocate(sum(ids.numel() for ids, _ in mbs), ARGS.hidden_size, torch.float32)
    eng.saved.start_step([ids.shape + (ARGS.hidden_size,) for ids, _ in mbs])
    eng.saved.save(0, torch.ones(mbs[0][0].shape + (ARGS.hidden_size,)))
    assert eng.saved._saved[0]
    eng.saved.close()
    assert all(saved == [] for saved in eng.saved._saved)


def test_host_ranges_that_share_a_page_are_registered_as_one():
    """cudaHostRegister locks whole pages and refuses a range touching a page already locked:
    blocks packed back to back (the object store) are merged into one range; blocks on pages
    of their own stay apart; empty ones are left out."""
    from appliance.engine.cuda_host import shared_page_spans

    page = 4096
    spans = [
        (10 * page + 100, 3 * page),  # 0: ends inside page 13 ...
        (13 * page + 200, page),  # 1: ... where this one starts: merged
        (20 * page, 2 * page),  # 2: pages 20-21 alone
        (22 * page, page),  # 3: starts on the next page: apart
        (30 * page, 0),  # 4: nothing to lock
        (5 * page, 64),  # 5: first in address order
    ]
    assert shared_page_spans(spans, page) == [
        (5 * page, 64, [5]),
        (10 * page + 100, 4 * page + 100, [0, 1]),
        (20 * page, 2 * page, [2]),
        (22 * page, page, [3]),
    ]


@pytest.mark.parametrize("copy_blocks", [False, True], ids=["in-place", "slots"])
@pytest.mark.parametrize("n_micro", [1, 4])
def test_a_quantized_block_is_dequantized_once_per_pass_whatever_the_micro_batches(
    copy_blocks, n_micro, monkeypatch
):
    """Layer-major: the forward dequantizes each block once for all its micro-batches, the
    backward once more (recomputing it): 2·L·7 projections a step, with 1 micro-batch or 4, and
    the time it took is the step's `dequant`."""
    from appliance.engine import device_weights as streaming

    calls = []

    def counting(q, dtype):
        calls.append(q.shape)
        return streaming_dequantize(q, dtype)

    streaming_dequantize = streaming.dequantize
    monkeypatch.setattr(streaming, "dequantize", counting)
    source = SyntheticBlockSource(ARGS, torch.float32, base_quant="nf4")
    eng = StreamedEngine(source, lora_with_random_b(ARGS), grad_clip=None, copy_blocks=copy_blocks)
    eng.weights.clear_timings()
    eng.forward_backward(micro_batches(n_micro), 0)
    assert len(calls) == 2 * L * 7
    assert eng.weights.take_timings()["dequant"] > 0


def test_blocks_through_the_staging_buffers_equal_blocks_read_in_place():
    """Where CUDA refuses to page-lock a block in place (cudaHostRegister fails: a container's
    memlock limit, a sandbox), each copy goes through one of two page-locked staging buffers,
    alternately, waiting for the copy out of a buffer before refilling it. On a CPU the same
    bookkeeping runs: the numbers are those of reading in place, bit for bit, and the steady
    state copies the bytes the planner counts."""
    source, ref, eng = engines()
    w = eng.weights
    w._host = [b._replace(pinned=False) for b in w._host]  # none page-locked in place
    w._staging = [torch.full((w._biggest,), 0xAB, dtype=torch.uint8) for _ in range(2)]
    w._staging_free, w._next_staging = [None, None], 0
    mbs = micro_batches()
    flat = source.flat_block(0)[0].nbytes
    for step in range(2):
        same_step(ref, eng, mbs, step)
        copied = w.take_timings()["h2d_bytes"]
    assert copied == blocks_uploaded_per_step(L, 0) * flat
    # both buffers carried blocks: each holds the bytes of a block it last copied
    blocks = [f for f, _, _ in w._host]
    for buf in w._staging:
        assert any(torch.equal(buf[: f.numel()], f) for f in blocks)
    assert all(done is not None for done in w._staging_free)


def test_a_plan_that_does_not_fit_the_budget_names_the_flags_that_fix_it(monkeypatch):
    """On a GPU with room to spare, a --gpu-memory-budget too small for even one streamed block
    and its activations is one error naming the budget and the two flags that shrink the need,
    before any slot is allocated (not a CUDA out-of-memory error mid-step)."""
    from appliance.errors import ConfigError

    _, _, eng = engines()
    eng.device, eng.budget = torch.device("cuda", 0), 1 << 20  # 1 MiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    slots_before = [id(t) for t in eng.weights._slots]
    with pytest.raises(ConfigError) as e:
        eng.plan(micro_batches())
    message = str(e.value)
    assert message.startswith("--gpu-memory-budget: ")
    assert "lower --micro-batch-size or --seq-len, or raise the budget" in message
    assert [id(t) for t in eng.weights._slots] == slots_before  # none made again
