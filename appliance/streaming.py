"""Block weights on the compute device: resident, streamed from host memory, or read in place.

`DeviceWeights` is what the streamed step (engine.py) asks for block i's weights. On CUDA it copies
block i±1 on a side stream from page-locked memory while block i computes (one flat byte copy per
block), keeps the blocks that the memory budget lets stay resident, and times the copies and the
compute stream's waits for them with CUDA events. On CPU the weights are read in place (nothing
is copied) and the wait for a block (its source producing it) is timed on the host clock.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import time
import warnings

import numpy as np
import torch

from .blocks import BlockSource, pack, unpack
from .quant import QuantizedTensor, dequantize, quantized_nbytes


class HostEvent:
    """A host-clock stand-in for `torch.cuda.Event(enable_timing=True)` on CPU, where work is
    synchronous: `record()` stamps the clock, `elapsed_time()` is in milliseconds as CUDA's."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = _clock()

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


_clock = time.perf_counter  # HostEvent's clock (a test swaps in one that ticks by exactly 1 s)


class DeviceWeights:
    """Block weights on the compute device: resident, prefetched on a side stream, or direct (CPU).

    Uploads are one flat byte copy per block, from page-locked host memory: a shared-memory buffer
    registered with CUDA in place when possible, else a pinned staging buffer (two, alternating).

    A quantized base (--base-quant) stays quantized up to the device: the flat buffer holds codes
    and scales, and `get(i)` dequantizes them into the compute dtype on the device, once per
    block per pass (the forward asks once for all micro-batches, the backward once more).
    """

    def __init__(self, source: BlockSource, device: torch.device, dtype: torch.dtype):
        self.source, self.device, self.dtype = source, device, dtype
        self.cuda = device.type == "cuda"
        self.resident: set[int] = set()  # blocks that, once uploaded, stay
        self._on_device: dict[int, tuple[dict[str, torch.Tensor], torch.cuda.Event | None]] = {}
        self.h2d_bytes = 0
        self._h2d_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # compute's waits for weights; on CPU the time to fetch a block from its source
        self._stall_events: list[tuple[torch.cuda.Event | HostEvent, ...]] = []
        self._registered: list[int] = []  # host addresses we cudaHostRegister'ed (close() undoes)
        g = source.globals()
        self.globals = {k: v.to(device=device, dtype=dtype) for k, v in g.items()}
        if self.cuda:
            self._stream = torch.cuda.Stream(device)
            self._host: list[tuple[torch.Tensor, dict, bool]] = []
            for i in range(source.num_blocks):
                flat, index, torch_pinned = _flat_block(source, i, dtype)
                self._host.append((flat, index, torch_pinned or self._register(flat)))
            biggest = max(f.numel() for f, _, _ in self._host)
            if not all(p for _, _, p in self._host):
                self._staging = [
                    torch.empty(biggest, dtype=torch.uint8, pin_memory=True) for _ in range(2)
                ]
                self._staging_free: list[torch.cuda.Event | None] = [None, None]
                self._next_staging = 0

    def _register(self, flat: torch.Tensor) -> bool:
        """Page-lock `flat` in place (cudaHostRegister, flags 0); False if refused (then we stage).

        Flags 0: the object store maps its pages writable (numpy marks them read-only, CUDA does
        not care), so cudaHostRegisterReadOnly is not needed.
        """
        lib = _cudart()
        if lib is None or flat.numel() == 0:
            return False
        with torch.cuda.device(self.device):
            if lib.cudaHostRegister(flat.data_ptr(), flat.numel(), 0) != 0:
                lib.cudaGetLastError()  # clear it: a refused registration must not fail a kernel
                return False
        self._registered.append(flat.data_ptr())
        return True

    def close(self) -> None:
        """Unregister the host memory this registered and drop device copies (idempotent).

        Must run before the host buffers are freed: a freed range still registered would make a
        later allocation at the same address look pinned (`is_pinned()` is True) while CUDA still
        maps the old pages. The object is unusable afterwards.
        """
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy may still be reading the buffers
        for ptr in self._registered:  # non-empty only if _cudart() found the runtime
            lib = _cudart()
            if lib.cudaHostUnregister(ptr) != 0:
                lib.cudaGetLastError()
        self._registered.clear()
        self._on_device.clear()
        self._host = []

    def block_bytes(self) -> int:
        """Bytes of one block as uploaded: flat, each tensor padded to 64 bytes (blocks.pack);
        a quantized weight counts its codes and scales."""
        return sum(_entry_bytes(t, self.dtype) for t in self.source.block(0).values())

    def dequant_bytes(self) -> int:
        """Device bytes the dequantized weights of one block take while it computes (0 when the
        base is not quantized): the transient that a quantized block adds on the device."""
        w = self.source.block(0)
        return sum(
            math.prod(t.shape) * self.dtype.itemsize
            for t in w.values()
            if isinstance(t, QuantizedTensor)
        )

    def prefetch(self, i: int) -> None:
        """Start copying block i to the device (no-op on CPU or if already there)."""
        if not self.cuda or i in self._on_device or not 0 <= i < self.source.num_blocks:
            return
        flat, index, pinned = self._host[i]
        with torch.cuda.stream(self._stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            dev = torch.empty(flat.numel(), dtype=torch.uint8, device=self.device)
            if pinned:
                dev.copy_(flat, non_blocking=True)
            else:
                k = self._next_staging
                self._next_staging = 1 - k
                if self._staging_free[k] is not None:
                    self._staging_free[
                        k
                    ].synchronize()  # the previous copy out of this slot is done
                buf = self._staging[k][: flat.numel()]
                buf.copy_(flat)  # host memcpy into page-locked memory
                dev.copy_(buf, non_blocking=True)
                self._staging_free[k] = torch.cuda.Event()
                self._staging_free[k].record()
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        self.h2d_bytes += flat.numel()
        self._h2d_events.append((start, done))
        self._on_device[i] = (unpack(dev, index), done)

    def get(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's weights, ready for use on the current stream."""
        if not self.cuda:  # read in place: the wait is the source's (a block made on first use)
            before, after = HostEvent(), HostEvent()
            before.record()
            w = self.source.block(i)
            after.record()
            self._stall_events.append((before, after))
            return _materialise(w, self.device, self.dtype)
        self.prefetch(i)
        w, done = self._on_device[i]
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            before = torch.cuda.Event(enable_timing=True)
            after = torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(done)  # compute waits for the copy: this gap is the h2d stall
            after.record(stream)
            self._stall_events.append((before, after))
            for t in w.values():
                for part in (t.codes, t.scales) if isinstance(t, QuantizedTensor) else (t,):
                    part.record_stream(stream)  # memory is freed only after compute has used it
            self._on_device[i] = (w, None)
        return _materialise(w, self.device, self.dtype)

    def release(self, i: int) -> None:
        """Drop block i from the device unless it is resident."""
        if self.cuda and i not in self.resident:
            self._on_device.pop(i, None)

    def stall_seconds(self) -> float:
        """Seconds compute has waited for weights since the last take or clear (syncs CUDA)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return sum(a.elapsed_time(b) for a, b in self._stall_events) / 1e3

    def take_timings(self) -> tuple[int, float, float]:
        """(h2d bytes, h2d copy seconds, h2d stall seconds) since the last take or clear; syncs
        CUDA. On CPU nothing is copied: (0, 0.0, the waits for the source's blocks)."""
        stall = self.stall_seconds()
        copy = sum(a.elapsed_time(b) for a, b in self._h2d_events) / 1e3
        n = self.h2d_bytes
        self.clear_timings()
        return n, copy, stall

    def clear_timings(self) -> None:
        """Forget what was recorded (no sync): a step starts here, so the copies and waits of an
        eval or a logits call since the last step are not counted in it."""
        self._h2d_events.clear()
        self._stall_events.clear()
        self.h2d_bytes = 0


def _materialise(
    w: dict[str, torch.Tensor | QuantizedTensor], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A block's weights as `dtype` tensors on `device`: quantized weights dequantized there
    (after their codes are moved, so a CPU-held block moves the quantized bytes), others cast."""
    return {
        k: dequantize(v.to(device), dtype)
        if isinstance(v, QuantizedTensor)
        else v.to(device=device, dtype=dtype)
        for k, v in w.items()
    }


def _entry_bytes(t: torch.Tensor | QuantizedTensor, dtype: torch.dtype) -> int:
    if isinstance(t, QuantizedTensor):
        return quantized_nbytes(t.shape, t.kind)
    return quantized_nbytes(tuple(t.shape), "none", dtype)


def _flat_block(source: BlockSource, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, dict, bool]:
    """Block i as (one flat uint8 host buffer, its index, whether torch itself pinned it).

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
    if isinstance(buf, np.ndarray):
        with warnings.catch_warnings():  # read-only shared memory: we never write through it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(buf), index, False
    return buf, index, buf.is_pinned()


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process has loaded, through ctypes; None if none is loaded.

    `torch.cuda.cudart()` binds cudaHostRegister but not cudaGetLastError, and a refused
    registration leaves a pending error that a later kernel-launch check would raise. Register,
    clear and unregister therefore all go through this handle: the same runtime torch uses (found
    in /proc/self/maps, so no second copy with its own error state and current device is loaded).
    Without it DeviceWeights does not register and copies through pinned staging buffers.
    """
    try:
        with open("/proc/self/maps") as f:
            paths = sorted(
                {
                    m[1]
                    for line in f
                    if (m := re.search(r"(/\S*/libcudart\.so[.\d]*)$", line.strip()))
                }
            )
    except OSError:
        return None
    if not paths:
        return None
    lib = ctypes.CDLL(paths[0])
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    for fn in (lib.cudaHostRegister, lib.cudaHostUnregister, lib.cudaGetLastError):
        fn.restype = ctypes.c_int
    return lib
