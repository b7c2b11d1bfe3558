"""This host's memory for a run: the shared-memory file system (/dev/shm, where Ray's object store
lives, and its huge-page policy) and the RAM available to new allocations. cluster/start.py sizes
the object store from these; `appliance doctor` checks them."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.hardware.measure import host_memory_available

SHM_DIR = "/dev/shm"


def shm_available_bytes(shm_dir: str = SHM_DIR) -> int | None:
    """Bytes free in the shared-memory file system (`df /dev/shm`'s Avail), None without one."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE_POLICIES = ("always", "within_size")  # 2 MiB pages without madvise (Ray does not madvise)


def tmpfs_huge_policy(
    path: Path, mounts: str | None = None, shmem_enabled: str | None = None
) -> str | None:
    """The `huge=` policy of the tmpfs that holds `path` ("never" when the mount does not say),
    or None when `path` is not on a tmpfs. The system-wide shmem_enabled overrides it when it says
    `deny` (never) or `force` (always). `mounts` and `shmem_enabled` default to /proc/self/mounts
    and the sysfs file."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None  # mount point, type, options: the longest prefix
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2], fields[3])
    if best is None or best[1] != "tmpfs":
        return None
    options = dict(o.split("=", 1) if "=" in o else (o, "") for o in best[2].split(","))
    policy = options.get("huge", "never")
    if shmem_enabled is None:
        try:
            shmem_enabled = Path(SHMEM_ENABLED).read_text()
        except OSError:
            shmem_enabled = ""
    chosen = next((w[1:-1] for w in shmem_enabled.split() if w.startswith("[")), "")
    if chosen == "deny":
        return "never"
    if chosen == "force":
        return "always"
    return policy


def ram_available_bytes() -> int:
    """RAM available to new allocations now: MemAvailable bounded by this container's memory
    limit (measure.host_memory_available); psutil's figure where there is no /proc (macOS)."""

    available = host_memory_available()
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return available
