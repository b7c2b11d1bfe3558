"""Saved block inputs of the streamed step: on the device, or offloaded to page-locked host memory.

The forward saves every block's input for every micro-batch; the backward recomputes block i
from them (engine/step.py). When they do not fit the budget (memory.plan_memory says
`offload_activations`) they go to the host:

- one page-locked host buffer for all of them, allocated once at plan time (`allocate`), each
  (block, micro-batch) a fixed range of it: no pinned allocation per tensor, per step;
- forward: each input is copied device→host on a stream of its own, after an event marks it
  computed, so the copy overlaps the next micro-batch's compute; except the last block's: the
  backward starts with it, so it is copied device→device into a slot, where the backward takes it
  (no round trip over PCIe, and no wait for one at the start of the backward);
- backward: while block i computes, block i−1's inputs are copied host→device on that stream into
  one of two device slots allocated once (the plan counts them), and the compute stream waits on
  the copy's event only when it reaches block i−1. A slot is reused once the compute stream has
  passed the event recorded when its block's backward was done with it.

Without offload (the plan's choice; on a CPU always, unless a test calls `allocate`) the inputs
stay where they are and this is a list per block. On a CPU `allocate` runs the same path with
plain memory, no streams and no events, so the tests check its bookkeeping without a GPU. The
numbers do not change with offload: the bytes go out and come back unchanged
(tests/engine/test_engine_step.py on a CPU, tests/engine/test_engine_gpu.py on CUDA, bit for bit).
"""

from __future__ import annotations

import weakref

import torch

from appliance.engine.cuda_host import page_locked_empty, unregister_all
from appliance.engine.device_weights import SideStream, event_seconds


class SavedInputs:
    """Block inputs saved by the forward for the backward's recompute (see module docstring)."""

    def __init__(self, device: torch.device, num_blocks: int):
        self.device, self.num_blocks = device, num_blocks
        self.offload = False
        self._saved: list[list[torch.Tensor | None]] = [[] for _ in range(num_blocks)]
        self._stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._registered: list[int] = []  # the host buffer's address, when registered in place
        self.h2d_bytes = 0  # saved inputs copied back to the device (take_h2d_bytes resets it)
        # an object dropped without close() (an exception on the way) unregisters it all the same
        weakref.finalize(self, unregister_all, self._registered, device)

    # ------------------------------------------------------------ plan time

    def allocate(self, tokens: int, hidden: int, dtype: torch.dtype) -> None:
        """Offload from now on: room for `tokens` positions (a step's global batch, all its
        micro-batches) of width `hidden` per block, on the host (one page-locked buffer) and in two
        device slots."""
        self.close()  # a second plan: the first plan's buffers go (after any copy using them)
        self.cuda = self.device.type == "cuda"
        self.offload, self.dtype, self.capacity = True, dtype, tokens * hidden
        n = self.num_blocks * self.capacity
        if self.cuda:  # registered in place: exactly its size (torch's pinned memory rounds up)
            self._host, registered = page_locked_empty(n, dtype, self.device)
            if registered:
                self._registered.append(self._host.data_ptr())
        else:
            self._host = torch.empty(n, dtype=dtype)
        self._slots = [
            torch.empty(self.capacity, dtype=dtype, device=self.device) for _ in range(2)
        ]
        self._slot_free: list[torch.cuda.Event | None] = [None, None]
        self._copier = SideStream(self.device)
        self._copier.wait_for_compute()  # the slots' memory may have been compute's just before
        self._layout: list[tuple[int, torch.Size]] = []  # per micro-batch: (offset, shape)
        # block → (its inputs in a device slot, the copy's event (None: compute's own), slot)
        self._loaded: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None, int]] = {}

    def start_step(self, shapes: list[torch.Size]) -> None:
        """A new forward whose micro-batches' hidden states have `shapes`: lays them out in each
        block's range of the host buffer (checked against what was allocated)."""
        self._saved = [[] for _ in range(self.num_blocks)]
        if not self.offload:
            return
        self._layout, offset = [], 0
        for shape in shapes:
            self._layout.append((offset, shape))
            offset += shape.numel()
        if offset > self.capacity:
            raise RuntimeError(
                f"saved inputs: this step has {offset} values per block, the plan allocated "
                f"{self.capacity}; plan for the biggest global batch first"
            )
        for i in list(self._loaded):  # a step that raised may have left a slot taken
            self._free(i)
        if self.cuda:  # ... and a copy into it in flight, which the last block's save must follow
            torch.cuda.current_stream(self.device).wait_stream(self._copier.stream)

    # ------------------------------------------------------------ forward

    def save(self, i: int, h: torch.Tensor) -> None:
        """Keep `h` (block i's input of the next micro-batch) for the backward."""
        if not self.offload:
            self._saved[i].append(h)
            return
        m = len(self._saved[i])
        offset, shape = self._layout[m]
        if i == self.num_blocks - 1:  # the backward's first block: kept on the device, in a slot
            self._keep_last(m, h)
            return
        host = self._host[i * self.capacity + offset :][: shape.numel()].view(shape)
        self._copier.wait_for_compute()  # h is computed
        with self._copier.copying():
            host.copy_(h, non_blocking=True)
        if self.cuda:
            h.record_stream(self._copier.stream)  # h's memory is not reused before the copy
        self._saved[i].append(host)  # the copy back, on the same stream, comes after this one

    def _keep_last(self, m: int, h: torch.Tensor) -> None:
        """The last block's input of micro-batch m, copied into slot 0 on the compute stream
        (ordered after compute's earlier use of that slot, and, by start_step, after any copy
        into it); the backward's `take` finds it there, ready, as if prefetched."""
        i, (offset, shape) = self.num_blocks - 1, self._layout[m]
        if m == 0:
            self._loaded[i] = ([], None, 0)
        dev = self._slots[0][offset : offset + shape.numel()].view(shape)
        dev.copy_(h)
        self._loaded[i][0].append(dev)
        self._saved[i].append(dev)

    # ------------------------------------------------------------ backward

    def prefetch(self, i: int) -> None:
        """Start copying block i's saved inputs to the device (no-op without offload, out of
        range, or if already started)."""
        if not self.offload or not 0 <= i < self.num_blocks or i in self._loaded:
            return
        slot = next(k for k in (0, 1) if k not in {s for _, _, s in self._loaded.values()})
        with self._copier.copying():
            self._copier.wait(self._slot_free[slot])  # its last block is done with it
            out = []
            for (offset, shape), host in zip(self._layout, self._saved[i], strict=False):
                dev = self._slots[slot][offset : offset + shape.numel()].view(shape)
                dev.copy_(host, non_blocking=True)
                self.h2d_bytes += host.numel() * host.element_size()
                out.append(dev)
            ready = self._copier.event()
            ready.record()
        self._loaded[i] = (out, ready, slot)

    def take(self, i: int) -> list[torch.Tensor]:
        """Block i's saved inputs on the device, ready on the compute stream; block i is then
        no longer kept (call `done(i)` once its backward is queued)."""
        if not self.offload:
            saved, self._saved[i] = self._saved[i], []
            return [t.to(self.device, non_blocking=True) for t in saved]
        self.prefetch(i)
        out, ready, _ = self._loaded[i]
        if not self.cuda or ready is None:  # the copy is done (CPU) or was compute's own (last)
            return list(out)
        # the copy back is a stall of compute if it is not done yet
        self._stall_events.append(self._copier.compute_waits(ready))
        return out

    def done(self, i: int) -> None:
        """Block i's backward is queued: its device slot is free once compute has passed here."""
        if self.offload and i in self._loaded:
            self._free(i)

    def _free(self, i: int) -> None:
        _, _, slot = self._loaded.pop(i)
        self._slot_free[slot] = self._copier.compute_mark()

    def close(self) -> None:
        """Unregister the page-locked host buffer (before it is freed) and drop the slots; no
        more offload until `allocate` again (idempotent)."""
        if getattr(self, "cuda", False):
            torch.cuda.synchronize(self.device)  # no copy may still use the buffers
        unregister_all(self._registered, self.device)
        self.offload = False
        self._host, self._slots, self._loaded = None, [], {}
        # the saved inputs are views of the host buffer: dropped with it (a second plan would
        # otherwise hold two page-locked buffers until the next step starts)
        self._saved = [[] for _ in range(self.num_blocks)]

    def take_h2d_bytes(self) -> int:
        """Bytes of saved inputs copied back to the device since the last call."""
        n, self.h2d_bytes = self.h2d_bytes, 0
        return n

    def take_stall_seconds(self) -> float:
        """Seconds compute waited for saved inputs to come back since the last call (syncs)."""
        if not self._stall_events:
            return 0.0
        torch.cuda.synchronize(self.device)
        seconds = event_seconds(self._stall_events)
        self._stall_events.clear()
        return seconds
