"""The RAM a run can take inside a container: /proc/meminfo is the host's, the container's memory
limit lives in its cgroup. `docker run --memory=64g` on a 512 GB host must be refused a 100 GB
weight store before it loads, not OOM-killed halfway through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from appliance.hardware.measure import (
    NO_CGROUP_LIMIT,
    _cgroup_dirs,
    cgroup_memory_headroom,
    host_memory_available,
    meminfo_available,
)
from tests.helpers_model import config_only_7b

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def fake_box(tmp: Path, cgroup_line: str, mem_available: int) -> tuple[Path, Path]:
    """A /proc with meminfo and self/cgroup, and an empty /sys/fs/cgroup, under `tmp`."""
    proc, root = tmp / "proc", tmp / "cgroup"
    (proc / "self").mkdir(parents=True)
    root.mkdir()
    (proc / "meminfo").write_text(
        f"MemTotal:       {4 * mem_available // 1024} kB\n"
        f"MemAvailable:   {mem_available // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    return proc, root


def cgroup(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text + "\n")


def test_cgroup_v2_container_limit_bounds_what_is_available(tmp_path):
    proc, root = fake_box(tmp_path, "0::/", mem_available=500 * GiB)
    cgroup(
        root,
        memory_max=str(64 * GiB),
        memory_current=str(10 * GiB),
        memory_stat=f"anon {8 * GiB}\ninactive_file {2 * GiB}\nactive_file 0",
    )
    # the reclaimable page cache is not taken: 64 - (10 - 2)
    assert cgroup_memory_headroom(proc, root) == 56 * GiB
    assert host_memory_available(proc, root) == 56 * GiB
    assert meminfo_available(proc) == 500 * GiB


def test_cgroup_v2_without_a_limit_leaves_meminfo(tmp_path):
    proc, root = fake_box(tmp_path, "0::/user.slice/session-1.scope", mem_available=30 * GiB)
    cgroup(root / "user.slice" / "session-1.scope", memory_max="max", memory_current="123")
    cgroup(root / "user.slice", memory_max="max", memory_current="456")
    assert cgroup_memory_headroom(proc, root) is None
    assert host_memory_available(proc, root) == 30 * GiB


def test_the_tightest_limit_of_the_cgroup_and_its_parents_counts(tmp_path):
    """A Kubernetes pod's limit sits on the pod's cgroup, above the container's own."""
    proc, root = fake_box(tmp_path, "0::/kubepods/pod1/ctr", mem_available=500 * GiB)
    cgroup(root / "kubepods", memory_max=str(400 * GiB), memory_current=str(100 * GiB))
    cgroup(root / "kubepods" / "pod1", memory_max=str(48 * GiB), memory_current=str(40 * GiB))
    cgroup(root / "kubepods" / "pod1" / "ctr", memory_max="max", memory_current=str(40 * GiB))
    assert cgroup_memory_headroom(proc, root) == 8 * GiB
    assert host_memory_available(proc, root) == 8 * GiB


def test_cgroup_v1_container_sees_its_own_cgroup_as_the_root(tmp_path):
    """Docker on cgroup v1 mounts the container's memory cgroup at /sys/fs/cgroup/memory, while
    /proc/self/cgroup still names the host's path (/docker/<id>), which does not exist inside."""
    line = "4:memory:/docker/0123abcd\n3:cpu,cpuacct:/docker/0123abcd"
    proc, root = fake_box(tmp_path, line, mem_available=500 * GiB)
    cgroup(
        root / "memory",
        memory_limit_in_bytes=str(16 * GiB),
        memory_usage_in_bytes=str(3 * GiB),
        memory_stat=f"cache {2 * GiB}\ntotal_inactive_file {1 * GiB}",
    )
    assert _cgroup_dirs(proc, root) == [root / "memory"]
    assert cgroup_memory_headroom(proc, root) == 14 * GiB


def test_cgroup_v1_unlimited_is_no_limit(tmp_path):
    proc, root = fake_box(tmp_path, "4:memory:/", mem_available=20 * GiB)
    unlimited = 2**63 - 4096  # what v1 writes for "no limit" (page-rounded)
    assert unlimited >= NO_CGROUP_LIMIT
    cgroup(root / "memory", memory_limit_in_bytes=str(unlimited), memory_usage_in_bytes="7")
    assert cgroup_memory_headroom(proc, root) is None
    assert host_memory_available(proc, root) == 20 * GiB


def test_no_proc_means_unknown(tmp_path):
    assert host_memory_available(tmp_path / "nowhere", tmp_path / "nowhere") is None


def own_v1_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory directory, if this box has one we may make children in."""
    dirs = _cgroup_dirs(Path("/proc"), Path("/sys/fs/cgroup"))
    if not dirs or not (dirs[0] / "memory.limit_in_bytes").exists():
        return None
    return dirs[0] if os.access(dirs[0], os.W_OK) else None


@pytest.mark.integration
def test_a_real_memory_cgroup_limit_refuses_a_model_the_host_could_hold(tmp_path):
    """The real kernel interface: a child memory cgroup with a 3 GiB limit, a model of about 5 GiB
    that this host's MemAvailable holds. doctor fails the ram check naming the limit, and train
    refuses before reading a weight."""
    parent = own_v1_memory_cgroup()
    if parent is None:
        pytest.skip(
            "no writable cgroup v1 memory hierarchy here (a cgroup v2 child would need "
            "the parent's subtree_control)"
        )
    host = meminfo_available()
    assert host is not None
    if host < 8 * GiB:
        pytest.skip(f"only {host / GiB:.1f} GiB available: the host could not hold the model")
    model = config_only_7b(tmp_path / "model", 5 * GiB)
    child = parent / f"appliance-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        (child / "memory.limit_in_bytes").write_text(str(3 * GiB))

        def enter():
            (child / "cgroup.procs").write_text(str(os.getpid()))

        def appliance(*argv: str) -> subprocess.CompletedProcess:
            code = "import sys; from appliance.cli.main import main; sys.exit(main())"
            return subprocess.run(
                [sys.executable, "-c", code, *argv],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                preexec_fn=enter,
                timeout=120,
                cwd=ROOT,
            )

        p = appliance("doctor", "--json", "--model", str(model), "--device", "cpu")
        assert "Traceback" not in p.stderr, p.stderr
        ram = {c["name"]: c for c in json.loads(p.stdout)["checks"]}["ram"]
        assert p.returncode == 1 and ram["status"] == "fail", ram
        assert "under this container's memory limit (the host has" in ram["detail"]
        assert ram["fix"].startswith("a memory limit of ") and "docker run --memory" in ram["fix"]

        data = tmp_path / "data.jsonl"
        data.write_text('{"text": "hello"}\n')
        out = tmp_path / "out"
        p = appliance(
            "train", "--model", str(model), "--data", str(data), "--output", str(out),
            "--device", "cpu", "--log-format", "plain",
        )  # fmt: skip
        assert p.returncode == 1, p.stderr
        assert "error: ram: " in p.stderr and "container's memory limit" in p.stderr
        assert "Traceback" not in p.stderr and not (out / "run.json").exists()
    finally:
        child.rmdir()
