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
    """Seconds of each of `reps` calls of `fn`, timed with CUDA events on the current stream.

    An untimed call goes first each time, so that the GPU is still busy with it when it reaches
    `start`: the timed call is then already queued, and the host's launch latency (~10 µs, a few
    % of a 4096³ matmul) is not counted as GPU time."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
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


def meminfo_available(proc: Path = Path("/proc")) -> int | None:
    """/proc/meminfo's MemAvailable in bytes: the whole host's, even inside a container."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


NO_CGROUP_LIMIT = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def _cgroup_dirs(proc: Path, cgroup_root: Path) -> list[Path]:
    """The memory cgroup directories of this process and of its parents, deepest first.

    /proc/self/cgroup names the cgroup as the host sees it ("0::/path" on v2, "N:memory:/path" on
    v1). A container's cgroup namespace (v2) shows "/", and a v1 container mounts its own cgroup as
    the root: where the named path does not exist, its parents and the root still do."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = cgroup_root  # v2: one unified hierarchy
        elif "memory" in controllers.split(","):
            base = cgroup_root / controllers  # v1: memory's own hierarchy
        else:
            continue
        parts = [p for p in path.split("/") if p]
        dirs += [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _inactive_file(stat: Path) -> int:
    """Page cache the kernel reclaims before the cgroup's OOM killer runs: not taken."""
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory_headroom(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process's cgroup and its parents let it allocate before their memory limit
    (`docker run --memory`, a Kubernetes pod's limit) calls the OOM killer: the smallest of
    limit − (usage − reclaimable page cache) over those that set a limit. None where none does.
    /dev/shm pages (Ray's object store) are charged to the cgroup that touched them."""
    headrooms = []
    for d in _cgroup_dirs(proc, cgroup_root):
        limit = _read_int(d / "memory.max")
        usage = _read_int(d / "memory.current")
        if limit is None:  # cgroup v1
            limit = _read_int(d / "memory.limit_in_bytes")
            usage = _read_int(d / "memory.usage_in_bytes")
        if limit is None or limit >= NO_CGROUP_LIMIT or usage is None:
            continue
        used = max(usage - _inactive_file(d / "memory.stat"), 0)
        headrooms.append(max(limit - used, 0))
    return min(headrooms) if headrooms else None


def host_memory_available(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """RAM a new allocation can take now: MemAvailable, bounded by the memory limit of this
    process's cgroup (a container's limit, which MemAvailable does not see). None where
    /proc/meminfo cannot be read (not Linux)."""
    available = meminfo_available(proc)
    if available is None:
        return None
    headroom = cgroup_memory_headroom(proc, cgroup_root)
    return available if headroom is None else min(available, headroom)
