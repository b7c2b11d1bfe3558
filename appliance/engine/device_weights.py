"""Block weights on the compute device: resident, streamed from host memory, or read in place.

`DeviceWeights` is what the streamed step (engine/step.py) asks for block i's weights. On CUDA it copies
block i±1 on a side stream from page-locked memory while block i computes (one flat byte copy per
block), keeps the blocks that the memory budget lets stay resident, and times the copies and the
compute stream's waits for them with CUDA events. On CPU the weights are read in place (nothing
is copied) and the wait for a block (its source producing it) is timed on the host clock.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import statistics
import time
import weakref
from typing import NamedTuple

import numpy as np
import torch

from appliance import models
from appliance.engine.blocks import BlockSource, pack, readonly_tensor, unpack
from appliance.engine.cuda_host import (
    host_register_range,
    page_locked_empty,
    shared_page_spans,
    unregister_all,
)
from appliance.engine.expert_streaming import ExpertBlock, expert_spans
from appliance.hardware.measure import cuda_copy_seconds
from appliance.models.moe import Layout
from appliance.quant import QuantizedTensor, dequantize, quantized_nbytes


class HostEvent:
    """A host-clock stand-in for `torch.cuda.Event(enable_timing=True)` on CPU, where work is
    synchronous: `record()` stamps the clock, `elapsed_time()` is in milliseconds as CUDA's."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: object = None) -> None:
        self.t = _clock()

    def synchronize(self) -> None:
        """Nothing to wait for: CPU work is done when it returns."""

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


_clock = time.perf_counter  # HostEvent's clock (a test swaps in one that ticks by exactly 1 s)


def with_index(device: torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" becomes the current CUDA device. Some torch.cuda
    calls (set_per_process_memory_fraction among them) refuse a CUDA device without one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def event_seconds(spans: list[tuple[torch.cuda.Event | HostEvent, ...]]) -> float:
    """Seconds between each (start, end) pair of recorded events, summed (CUDA: after a sync)."""
    return sum(a.elapsed_time(b) for a, b in spans) / 1e3


class SideStream:
    """A CUDA stream for copies beside the compute stream, and the events that order the two
    (DeviceWeights' block uploads, SavedInputs' activation copies). On a CPU (the tests' copy
    paths) there is no stream: a copy is done when it returns, so every wait is a no-op and
    timing events read the host clock."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def copying(self):
        """Context: work queued inside it goes on the side stream."""
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def event(self, timing: bool = False) -> torch.cuda.Event | HostEvent:
        return torch.cuda.Event(enable_timing=timing) if self.cuda else HostEvent()

    def wait_for_compute(self) -> None:
        """Later side-stream work comes after everything compute has queued so far."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Later side-stream work comes after `event` (None: nothing to wait for)."""
        if self.cuda and event is not None:
            self.stream.wait_event(event)

    def compute_mark(self) -> torch.cuda.Event | None:
        """An event recorded now on the compute stream (None on a CPU): e.g. "the compute stream
        is done with this slot" once it passes here."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_waits(self, event: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Make compute wait for `event` (a copy's); the (before, after) timing events around the
        wait, whose gap is compute stalled on that copy. CUDA only."""
        compute = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(event)
        after.record(compute)
        return before, after


class DeviceWeights:
    """Block weights on the compute device: resident, prefetched on a side stream, or direct (CPU).

    Uploads are one flat byte copy per block, from page-locked host memory: a shared-memory buffer
    registered with CUDA in place when possible, else a pinned staging buffer (two, alternating).

    `copies=True` on a CPU runs that same path (flat host buffers copied into resident buffers and
    streaming slots, with host-clock events and no streams): what the tests use to check the
    slots' bookkeeping and that copying changes no number, on machines without a GPU.

    A quantized base (--base-quant) stays quantized up to the device: the flat buffer holds codes
    and scales, and `get(i)` dequantizes them into the compute dtype on the device, once per
    block per pass (the forward asks once for all micro-batches, the backward once more).

    `experts` (a MoE model's moe.Layout, its experts stored apart): streamed blocks cross by
    expert, their experts copied when a token is routed to them (engine/expert_streaming.py);
    not for a quantized base.
    """

    def __init__(
        self,
        source: BlockSource,
        device: torch.device,
        dtype: torch.dtype,
        copies: bool = False,
        experts: Layout | None = None,
    ):
        self.source, self.device, self.dtype = source, device, dtype
        self.cuda = device.type == "cuda"
        self.copies = self.cuda or copies  # blocks are copied to the device (else read in place)
        self.resident: set[int] = set()  # blocks that, once uploaded, stay (configure sets it)
        # block -> (its weights on the device, the copy's done event until compute waited on it,
        # the streaming slot it occupies or None for a resident block's own buffer)
        self._on_device: dict[int, tuple[dict, torch.cuda.Event | None, int | None]] = {}
        self.h2d_bytes = 0
        # expert-granular streaming: experts copied, and experts whole-block copies would have
        # copied (E per streamed MoE block copy): their ratio is the step's `expert_share`
        self.experts_moved = self.experts_streamed = 0
        self._h2d_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # compute's waits for weights; on CPU the time to fetch a block from its source
        self._stall_events: list[tuple[torch.cuda.Event | HostEvent, ...]] = []
        self._dequant_events: list[tuple[torch.cuda.Event | HostEvent, ...]] = []
        self.host_seconds = 0.0  # host time blocked in prefetch: staging waits and memcpy
        self._registered: list[int] = []  # host addresses we cudaHostRegister'ed (close() undoes)
        # an object dropped without close() (an exception on the way) unregisters them all the same
        weakref.finalize(self, unregister_all, self._registered, device)
        self._slots: list[torch.Tensor] = []  # streaming slots: flat device buffers, made once
        self._slot_free: list[torch.cuda.Event | None] = []  # recorded when a slot's block left
        self._free_slots: list[int] = []
        self._resident_buffers: dict[int, torch.Tensor] = {}  # allocated by configure, not filled
        self._configured = False
        quantized = any(isinstance(t, QuantizedTensor) for t in source.block(0).values())
        self._layout = experts if experts is not None and not quantized else None
        self._experts_on: dict[int, set[int]] = {}  # streamed block → its experts on the device
        self._used: dict[int, set[int]] = {}  # block → experts routed to since forget_routing
        # block → experts its previous pass routed to: what a forward prefetches (a prediction)
        self._routed_before: dict[int, set[int]] = {}
        self.expert_waits = 0  # on-demand expert copies compute waited for (not prefetched)
        self._dev: dict[int, torch.Tensor] = {}  # streamed block → its slot's bytes
        g = source.globals()
        # Gemma 4's per-layer embedding table stays in host memory (models.HOST_GLOBALS): its
        # rows for a step's tokens are gathered there (models.block_state)
        self.host_globals = {k: v for k, v in g.items() if k in models.HOST_GLOBALS}
        self.globals = {
            k: v.to(device=device, dtype=dtype) for k, v in g.items() if k not in self.host_globals
        }
        self._copier = SideStream(device)
        # with copies: each block's host buffer, the biggest's size, and two page-locked
        # staging buffers for the blocks that could not be locked in place
        self._host: list[HostBlock] = []
        self._biggest = 0
        self._staging: list[torch.Tensor] = []  # none when every block is page-locked
        self._staging_free: list[torch.cuda.Event | None] = [None, None]
        self._next_staging = 0
        if self.copies:
            blocks = [_flat_block(source, i, dtype) for i in range(source.num_blocks)]
            # on a CPU nothing needs page-locking: every buffer is copied from directly
            pinned = [not self.cuda or b.pinned for b in blocks]
            todo = [i for i, p in enumerate(pinned) if not p]
            spans = [(blocks[i].flat.data_ptr(), blocks[i].flat.numel()) for i in todo]
            for start, nbytes, members in shared_page_spans(spans, mmap.PAGESIZE):
                if self._register(start, nbytes):
                    for j in members:
                        pinned[todo[j]] = True
            self._host = [b._replace(pinned=p) for b, p in zip(blocks, pinned, strict=True)]
            self._biggest = max(b.flat.numel() for b in self._host)
            if not all(b.pinned for b in self._host):
                self._staging = [self._page_locked(self._biggest) for _ in range(2)]

    def configure(self, resident: set[int], slots: int = 2) -> None:
        """Keep the blocks `resident` on the device once uploaded, and stream the others through
        `slots` fixed device buffers of the biggest block's size, allocated here, once.

        Two slots suffice for the streamed step: block i computes in one while block i±1 is
        copied into the other. A slot is reused only after the compute stream has passed the
        event recorded when its previous block was released (the copy stream waits on it), so a
        streamed block never goes through the caching allocator: no allocation, no
        `record_stream`, no allocator retry under a tight budget (docs/architecture.md).
        """
        if self.cuda:  # no copy may still write the slots or resident buffers we drop
            torch.cuda.synchronize(self.device)
        self.resident = set(resident)
        self._configured = True
        # what stays: blocks uploaded into their own buffer that remain resident (a block that
        # was in a streaming slot goes with the slots, whether it is resident now or not)
        for i, (_, _, slot) in list(self._on_device.items()):
            if i not in self.resident or slot is not None:
                del self._on_device[i]
                self._experts_on.pop(i, None)
        self._slots, self._slot_free, self._free_slots = [], [], []
        if not self.copies:
            return
        # each resident block's own buffer, allocated now with the slots (the plan counts both):
        # not in the middle of the first step, between its activations
        self._resident_buffers = {
            i: torch.empty(self._host[i].flat.numel(), dtype=torch.uint8, device=self.device)
            for i in sorted(self.resident)
            if i not in self._on_device and 0 <= i < self.source.num_blocks
        }
        if len(self.resident) >= self.source.num_blocks:
            self._copier.wait_for_compute()  # the buffers' memory may have been compute's
            return
        self._slots = [
            torch.empty(self._biggest, dtype=torch.uint8, device=self.device) for _ in range(slots)
        ]
        self._slot_free = [None] * slots
        self._free_slots = list(range(slots))
        # the slots' memory may come from the allocator's cache, last used by compute: the first
        # copy into them must come after that work
        self._copier.wait_for_compute()

    def drop_streamed(self, keep: int | None = None) -> None:
        """Release every streamed block on the device but `keep`: what a step that raised midway
        left in the slots (the engine calls it before each pass, keeping block 0)."""
        for i in [i for i in self._on_device if i != keep and i not in self.resident]:
            self.release(i)

    def _page_locked(self, nbytes: int) -> torch.Tensor:
        t, registered = page_locked_empty(nbytes, torch.uint8, self.device)
        if registered:
            self._registered.append(t.data_ptr())
        return t

    def _register(self, ptr: int, nbytes: int) -> bool:
        """Page-lock `nbytes` of host memory at `ptr` in place (host_register); close() undoes
        it."""
        if not host_register_range(ptr, nbytes, self.device):
            return False
        self._registered.append(ptr)
        return True

    def close(self) -> None:
        """Unregister the host memory this registered and drop device copies (idempotent).

        Must run before the host buffers are freed: a freed range still registered would make a
        later allocation at the same address look pinned (`is_pinned()` is True) while CUDA still
        maps the old pages. The object is unusable afterwards.
        """
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy may still use the buffers we drop
        unregister_all(self._registered, self.device)
        self._on_device.clear()
        self._host = []
        self._slots, self._free_slots, self._resident_buffers = [], [], {}

    def block_bytes(self) -> int:
        """Bytes of one block as uploaded: flat, each tensor padded to 64 bytes (blocks.pack);
        a quantized weight counts its codes and scales."""
        return max(  # the biggest block: blocks differ by kind in Qwen3.5 and Gemma 4
            sum(_entry_bytes(t, self.dtype) for t in self.source.block(i).values())
            for i in range(self.source.num_blocks)
        )

    def dequant_bytes(self) -> int:
        """Device bytes the dequantized weights of one block take while it computes (0 when the
        base is not quantized): the transient that a quantized block adds on the device."""
        return max(
            sum(
                math.prod(t.shape) * self.dtype.itemsize
                for t in self.source.block(i).values()
                if isinstance(t, QuantizedTensor)
            )
            for i in range(self.source.num_blocks)
        )

    def prefetch(self, i: int) -> None:
        """Start copying block i to the device (no-op if blocks are read in place, or if it is
        already there): into its own buffer if it is resident, else into a free streaming slot."""
        if not self.copies or i in self._on_device or not 0 <= i < self.source.num_blocks:
            return
        if not self._configured:
            self.configure(set())
        flat, index, pinned = self._host[i]
        t0 = time.perf_counter()
        if i in self.resident:  # its own buffer (configure allocated it), kept until close
            slot, dev = None, self._resident_buffers.pop(i, None)
            if dev is None:
                dev = torch.empty(flat.numel(), dtype=torch.uint8, device=self.device)
                self._copier.wait_for_compute()  # its memory may have just been freed by compute
        else:
            if not self._free_slots:
                raise RuntimeError(
                    f"block {i}: no free streaming slot (blocks {sorted(self._on_device)} hold "
                    f"the {len(self._slots)} slots); release a block first"
                )
            slot = self._free_slots.pop(0)
            dev = self._slots[slot][: flat.numel()]
        spans = None  # the whole block
        if self._layout is not None and slot is not None:  # its dense part, and the experts
            dense, experts = expert_spans(index, self._layout)  # its last forward routed to
            # the backward: what this pass's forward routed to; a forward: what the block's
            # previous pass routed to (a prediction: a miss is copied when routed to, an extra
            # is copied for nothing), so the copy overlaps the previous block's compute
            used = (self._used.get(i) or self._routed_before.get(i, set())) & set(experts)
            spans = dense + [s for j in sorted(used) for s in experts[j]]
            self._experts_on[i], self._dev[i] = used, dev
            self.experts_moved += len(used)
            self.experts_streamed += len(experts)
        try:
            start, done = self._copy(dev, flat, pinned, slot, spans)
        except BaseException:  # (a KeyboardInterrupt in the staging wait): the slot stays free
            if slot is not None:
                self._free_slots.insert(0, slot)
            self._experts_on.pop(i, None)
            raise
        self.host_seconds += time.perf_counter() - t0
        self.h2d_bytes += flat.numel() if spans is None else sum(b - a for a, b in spans)
        self._h2d_events.append((start, done))
        self._on_device[i] = (unpack(dev, index), done, slot)

    def _fetch_experts(self, i: int, experts) -> None:
        """Copy into block i's slot those of `experts` not there yet (expert-granular
        streaming); compute waits for them (an h2d stall, as for a block)."""
        experts = set(experts)
        self._used.setdefault(i, set()).update(experts)
        new = sorted(experts - self._experts_on[i])
        if not new:
            return
        t0 = time.perf_counter()
        flat, index, pinned = self._host[i]
        _, spans = expert_spans(index, self._layout)
        todo = [s for j in new for s in spans.get(j, [])]
        start, done = self._copy(self._dev[i], flat, pinned, None, todo)
        self.host_seconds += time.perf_counter() - t0
        self.h2d_bytes += sum(b - a for a, b in todo)
        self.experts_moved += len(new)
        self.expert_waits += 1
        self._h2d_events.append((start, done))
        if self.cuda:
            self._stall_events.append(self._copier.compute_waits(done))
        self._experts_on[i].update(new)

    def forget_routing(self) -> None:
        """A new pass starts: the experts its blocks need are not known until each block's
        forward routes; its prefetches copy the dense part and the experts the block's previous
        pass routed to (none on the first pass), and the forward copies any others when routed
        to (`expert_waits` counts those copies: compute waits for them)."""
        self._routed_before.update(self._used)
        self._used.clear()

    def _copy(
        self,
        dev: torch.Tensor,
        flat: torch.Tensor,
        pinned: bool,
        slot: int | None,
        spans: list[tuple[int, int]] | None = None,
    ) -> tuple[torch.cuda.Event | HostEvent, torch.cuda.Event | HostEvent]:
        """Queue `flat` → `dev` on the copy stream, after the slot's last block is done with it
        (through a pinned staging buffer if `flat` is not page-locked); its (start, done) events.
        `spans`: only those byte ranges (expert-granular streaming), at their own offsets."""
        spans = [(0, flat.numel())] if spans is None else spans
        with self._copier.copying():
            if slot is not None:
                self._copier.wait(self._slot_free[slot])  # its last block is done with it
            src = flat
            if not pinned:  # through a page-locked staging buffer: host work, timed on the host
                k = self._next_staging
                self._next_staging = 1 - k
                if self._staging_free[k] is not None:
                    self._staging_free[k].synchronize()  # the copy out of this buffer is done
                src = self._staging[k][: flat.numel()]
                for a, b in spans:
                    src[a:b].copy_(flat[a:b])  # host memcpy into page-locked memory
            start = self._copier.event(timing=True)
            start.record()  # right before the copy: the copy's time is the DMA's alone
            for a, b in spans:
                dev[a:b].copy_(src[a:b], non_blocking=True)
            done = self._copier.event(timing=True)
            done.record()
            if not pinned:
                self._staging_free[k] = done
        return start, done

    def get(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's weights, ready for use on the current stream."""
        if not self.copies:  # read in place: the wait is the source's (a block made on first use)
            before, after = HostEvent(), HostEvent()
            before.record()
            w = self.source.block(i)
            after.record()
            self._stall_events.append((before, after))
            return self._materialise(w)
        self.prefetch(i)
        w, done, slot = self._on_device[i]
        if done is not None:
            if self.cuda:  # on a CPU the copy was done when prefetch returned
                # compute waits for the copy: this gap is the h2d stall
                self._stall_events.append(self._copier.compute_waits(done))
            self._on_device[i] = (w, None, slot)
        if i in self._experts_on:  # streamed by expert: they come when routed to
            return ExpertBlock(
                self._materialise(w), self._layout, lambda js: self._fetch_experts(i, js)
            )
        return self._materialise(w)

    def _materialise(self, w: dict) -> dict[str, torch.Tensor]:
        """A block's weights as compute-dtype tensors on the device: quantized weights
        dequantized there (after their codes are moved, so a CPU-held block moves the quantized
        bytes), timed as `dequant` (CUDA events, or the host clock on CPU); others cast (a
        no-op for weights already in the compute dtype: views of the slot)."""
        if not any(isinstance(v, QuantizedTensor) for v in w.values()):
            return {k: v.to(device=self.device, dtype=self.dtype) for k, v in w.items()}
        before, after = self._copier.event(timing=True), self._copier.event(timing=True)
        before.record()
        out = {
            k: dequantize(v.to(self.device), self.dtype)
            if isinstance(v, QuantizedTensor)
            else v.to(device=self.device, dtype=self.dtype)
            for k, v in w.items()
        }
        after.record()
        self._dequant_events.append((before, after))
        return out

    def release(self, i: int) -> None:
        """Drop block i from the device unless it is resident; its slot is free for the next
        copy once the compute stream has done what it queued so far (an event marks that)."""
        if not self.copies or i in self.resident or i not in self._on_device:
            return
        _, _, slot = self._on_device.pop(i)
        self._experts_on.pop(i, None)
        self._dev.pop(i, None)
        if slot is not None:
            self._slot_free[slot] = self._copier.compute_mark()
            self._free_slots.append(slot)

    def reload(self, i: int) -> None:
        """Block i's host weights changed (full fine-tuning, engine/full.py): forget its device
        copy, resident or streamed, so the next get or prefetch copies the new weights."""
        if not self.copies or i not in self._on_device:
            return
        _, _, slot = self._on_device.pop(i)
        if slot is not None:
            self._slot_free[slot] = self._copier.compute_mark()
            self._free_slots.append(slot)

    def measure_bandwidth(self, reps: int = 10) -> float:
        """Bytes/s host→device from the memory the engine copies from: block 0's flat host
        buffer when it is page-locked in place (registered object-store pages, or torch-pinned),
        else the pinned staging buffer it goes through; copied into the device `reps` times (one
        warm-up before), each timed with events; the median. CUDA only; call it between steps
        (it uses a free streaming slot, or a temporary buffer)."""
        torch.cuda.synchronize(self.device)  # no copy may still read the staging buffer
        flat, _, pinned = self._host[0]
        src = flat if pinned else self._staging[0][: flat.numel()]
        if not pinned:
            src.copy_(flat)
        free = len(self._free_slots) == len(self._slots) > 0
        dst = self._slots[0][: flat.numel()] if free else torch.empty_like(src, device=self.device)
        torch.cuda.synchronize(self.device)
        return flat.numel() / statistics.median(cuda_copy_seconds(dst, src, reps))

    def stall_seconds(self) -> float:
        """Seconds compute has waited for weights since the last take or clear (syncs CUDA)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return event_seconds(self._stall_events)

    def take_timings(self) -> dict[str, float]:
        """What the weights cost since the last take or clear (syncs CUDA): `h2d_bytes` copied,
        `h2d_seconds` of copy (DMA) time, `h2d_stall` (compute waiting for a copy), `h2d_host`
        (host time blocked in prefetch: staging waits and memcpy), `dequant` seconds (device
        time between events on the compute stream, or the host clock on CPU), `expert_share`
        (expert-granular streaming: the experts copied over those whole-block copies would
        have copied, i.e. the mean share of a streamed MoE block's experts that crossed per
        copy of it; None when no block streamed by expert). On CPU without `copies` nothing is
        copied: the stall is the waits for the source's blocks."""
        if self.cuda:  # every event recorded so far has completed: elapsed_time may ask them
            torch.cuda.synchronize(self.device)
        out = {
            "h2d_bytes": self.h2d_bytes,
            "h2d_seconds": event_seconds(self._h2d_events),
            "h2d_stall": event_seconds(self._stall_events),
            "h2d_host": self.host_seconds,
            "dequant": event_seconds(self._dequant_events),
            "expert_share": self.experts_moved / self.experts_streamed
            if self.experts_streamed
            else None,
            "expert_waits": self.expert_waits,
        }
        self.clear_timings()
        return out

    def clear_timings(self) -> None:
        """Forget what was recorded (no sync): a step starts here, so the copies and waits of an
        eval or a logits call since the last step are not counted in it."""
        self._h2d_events.clear()
        self._stall_events.clear()
        self._dequant_events.clear()
        self.h2d_bytes = 0
        self.experts_moved = self.experts_streamed = self.expert_waits = 0
        self.host_seconds = 0.0


def _entry_bytes(t: torch.Tensor | QuantizedTensor, dtype: torch.dtype) -> int:
    if isinstance(t, QuantizedTensor):
        return quantized_nbytes(t.shape, t.kind)
    return quantized_nbytes(tuple(t.shape), "none", dtype)


class HostBlock(NamedTuple):
    """One block in host memory, as DeviceWeights copies it from."""

    flat: torch.Tensor  # every tensor of the block in one uint8 buffer (blocks.pack's layout)
    index: dict  # where each tensor is in it (blocks.layout)
    pinned: bool  # page-locked: copied from directly (else through a staging buffer)


def _flat_block(source: BlockSource, i: int, dtype: torch.dtype) -> HostBlock:
    """Block i as one flat uint8 host buffer, its index, and whether torch itself pinned it.

    Converted once here if the source holds another dtype; the WeightStore already stores the
    compute dtype, so no copy then. Buffers from numpy (the object store, `pack`) are never
    torch-pinned: for them `is_pinned()` could only be a stale registration, so it is not asked.
    """
    w = source.block(i)
    flat = getattr(source, "flat_block", None)
    if flat is not None and all(
        isinstance(t, QuantizedTensor) or t.dtype == dtype for t in w.values()
    ):
        buf, index = flat(i)
    else:
        buf, index = pack(
            {k: v if isinstance(v, QuantizedTensor) else v.to(dtype) for k, v in w.items()}
        )
    if isinstance(buf, np.ndarray):  # read-only shared memory: we never write through it
        return HostBlock(readonly_tensor(buf), index, False)
    return HostBlock(buf, index, buf.is_pinned())
