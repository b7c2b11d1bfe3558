"""GPU utilization as nvidia-smi sees it: NVML sampled on a background thread, averaged per step.

NVML's "GPU utilization" is the share of a recent window (1/6 s to 1 s, by product) in which any
kernel ran. The appliance reports it beside its own CUDA-event busy ratio, so a dashboard can show
"busy as the appliance measures it" next to "utilization as nvidia-smi sees it".

    sampler = NvmlSampler.for_cuda_device(torch.cuda.current_device())   # None without NVML
    if sampler: sampler.start()
    ...                                                                  # one step
    stats["nvml_util_mean"] = sampler.take_mean() if sampler else None   # 0..1
    ...
    if sampler: sampler.stop()

NVML comes from nvidia-ml-py (`pynvml`) when installed, else from the copy Ray ships (Ray's own GPU
metrics use it). Importable without a GPU: `for_cuda_device` returns None where NVML cannot start.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

DEFAULT_HZ = 20.0  # NVML's own window is >= 1/6 s; 20 Hz sees every window at least once


class NvmlSampler:
    """Calls `read()` (GPU utilization in percent, 0..100) `hz` times a second on a daemon
    thread; `take_mean()` returns the mean since the previous call as a ratio (0..1)."""

    def __init__(self, read: Callable[[], float], hz: float = DEFAULT_HZ, name: str = "gpu"):
        if hz < 10:
            raise ValueError(f"NVML sampling rate must be >= 10 Hz (got {hz})")
        self._read = read
        self.interval = 1.0 / hz
        self.name = name
        self._lock = threading.Lock()
        self._sum = 0.0
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    @classmethod
    def for_cuda_device(cls, cuda_index: int = 0, hz: float = DEFAULT_HZ) -> NvmlSampler | None:
        """A sampler for CUDA device `cuda_index` of this process, or None where NVML is not
        available (no nvidia-ml-py, no driver, no GPU). CUDA indices honour
        CUDA_VISIBLE_DEVICES (Ray sets it per actor); NVML's do not, so the device is found by
        UUID when torch knows it, else through CUDA_VISIBLE_DEVICES."""
        pynvml = _import_pynvml()
        if pynvml is None:
            return None
        try:
            pynvml.nvmlInit()
            handle = _nvml_handle(pynvml, cuda_index)
            name = pynvml.nvmlDeviceGetName(handle)
        except Exception as e:  # pynvml.NVMLError and friends: no driver, no such device
            logger.info("NVML unavailable, GPU utilization not sampled: %s", e)
            return None

        def read() -> float:
            return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

        return cls(read, hz=hz, name=name.decode() if isinstance(name, bytes) else str(name))

    def start(self) -> NvmlSampler:
        """Start sampling (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling and wait for the thread to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1.0)
            self._thread = None

    def take_mean(self) -> float | None:
        """Mean utilization (0..1) of the samples since the last call, then start afresh.
        None when no sample was taken in between (e.g. a step shorter than one interval)."""
        with self._lock:
            total, count = self._sum, self._count
            self._sum, self._count = 0.0, 0
        return total / count / 100.0 if count else None

    @property
    def samples_pending(self) -> int:
        """Samples taken since the last take_mean()."""
        with self._lock:
            return self._count

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                value = self._read()
            except Exception:  # a failed read is skipped, not fatal to training
                self.errors += 1
            else:
                with self._lock:
                    self._sum += value
                    self._count += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _import_pynvml():  # type: ignore[no-untyped-def]
    """nvidia-ml-py's `pynvml` if installed, else the copy Ray ships (what Ray's own GPU metrics
    use), else None."""
    try:
        import pynvml

        return pynvml
    except ImportError:
        pass
    try:
        import ray._private.thirdparty.pynvml as pynvml

        return pynvml
    except ImportError:
        return None


def _nvml_handle(pynvml, cuda_index: int):  # type: ignore[no-untyped-def]
    """NVML handle of this process's CUDA device `cuda_index`."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # no torch CUDA, or an old torch/driver without UUIDs: fall through
        pass
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    if visible:
        entry = visible[cuda_index]
        if entry.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
