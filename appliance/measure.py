"""What `appliance bench` measures about the machine itself: the names of its processors, the
host→device bandwidth B, the dense matmul rate P, the host memory available."""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

MiB, GiB = 2**20, 2**30
COPY_BYTES = 256 * MiB  # per bandwidth measurement


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / GiB:.0f} GiB)"
    return f"{cpu_name()} ({torch.get_num_threads()} threads, {os.cpu_count()} CPUs)"


def cuda_seconds(fn, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn`, timed with CUDA events on the current stream."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def cuda_copy_seconds(dst: torch.Tensor, src: torch.Tensor, reps: int) -> list[float]:
    """Seconds of `reps` copies src → dst on the current stream, each timed with CUDA events
    (after one untimed copy)."""
    dst.copy_(src, non_blocking=True)  # warm-up
    return cuda_seconds(lambda: dst.copy_(src, non_blocking=True), reps)


def measure_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, reps: int = 5) -> float:
    """Bytes/s: pinned host→device copies on CUDA, host memcpy on CPU (the best of `reps`)."""
    best = math.inf
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        best = min(cuda_copy_seconds(dst, src, reps))
        del src, dst
        torch.cuda.empty_cache()
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """FLOP/s of an (n, n) @ (n, n) matmul in `dtype`.

    CUDA: matmuls for at least a second first (clocks and power settle), then the median of `reps`
    matmuls each timed with events; CPU: the best of `reps` single matmuls.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    if device.type == "cuda":
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:  # warm up for ≥ 1 s
            torch.matmul(a, b, out=out)
            torch.cuda.synchronize(device)
        seconds = statistics.median(cuda_seconds(lambda: torch.matmul(a, b, out=out), reps))
    else:
        seconds = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.matmul(a, b, out=out)
            seconds = min(seconds, time.perf_counter() - t0)
    return 2 * n**3 / seconds


def host_memory_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
