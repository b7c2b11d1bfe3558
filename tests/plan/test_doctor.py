"""`appliance doctor` against real conditions made here: a lowered RLIMIT_MEMLOCK, a model bigger
than this box's RAM (config.json only), a busy port, a small tmpfs as /dev/shm; and `train`
refusing a too-big model before it reads any weight."""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

import appliance.plan.doctor as doctor_module
from appliance.cli.main import main
from appliance.config import TrainConfig, validate
from appliance.hardware.measure import host_memory_available
from appliance.metrics.endpoint import port_is_free
from appliance.models.presets import PRESETS
from appliance.plan.doctor import blocking_problems, check_port
from tests.helpers_model import config_only_7b
from tests.helpers_net import free_port

ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["tests.s3_server"]


def appliance(*argv: str, env: dict | None = None, preexec_fn=None) -> subprocess.CompletedProcess:
    """Run the CLI of this checkout in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    code = "import sys; from appliance.cli.main import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
        timeout=120,
        cwd=ROOT,
    )


def doctor(*argv: str, **kw) -> tuple[int, dict[str, dict]]:
    """`appliance doctor --json ARGV` in a subprocess (for a process-wide limit of its own)."""
    p = appliance("doctor", "--json", *argv, **kw)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, {c["name"]: c for c in json.loads(p.stdout)["checks"]}


def doctor_here(*argv: str) -> tuple[int, dict[str, dict]]:
    """`appliance doctor --json ARGV` in this process (click's runner: exit code and output)."""
    out = CliRunner().invoke(main, ["doctor", "--json", *argv])
    assert out.exception is None or isinstance(out.exception, SystemExit), out.output
    return out.exit_code, {c["name"]: c for c in json.loads(out.output)["checks"]}


def failed(checks: dict[str, dict]) -> set[str]:
    return {name for name, c in checks.items() if c["status"] == "fail"}


def huge_model(tmp: Path) -> Path:
    """A config.json (no weights) whose fp32 weight store is twice this box's available RAM."""
    avail = host_memory_available()
    assert avail is not None
    return config_only_7b(tmp, 2 * avail)


@pytest.mark.integration  # a subprocess: the limit is the process's own
def test_a_low_memlock_is_reported_but_blocks_nothing():
    """The NVIDIA driver page-locks without charging RLIMIT_MEMLOCK (tests/engine/test_engine_gpu.py
    checks that on a GPU): Docker's default limit must not refuse a run."""
    limit = 64 * 1024

    def lower():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))

    # --device cuda: page-locking is what a GPU run needs (on this CPU box the gpus check fails)
    _, checks = doctor("--preset", "tiny", "--device", "cuda", preexec_fn=lower)
    c = checks["memlock"]
    assert c["status"] == "ok"
    assert c["detail"].startswith("ulimit -l (memlock): 0.1 MiB; the GPU driver page-locks")
    assert "no --ulimit memlock needed" in c["detail"]
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))  # this process's soft limit
    try:
        assert blocking_problems(PRESETS["tiny"].args, cuda=True) == []
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_a_model_bigger_than_ram_fails_the_ram_check(tmp_path):
    model = huge_model(tmp_path / "model")
    rc, checks = doctor_here("--model", str(model), "--device", "cpu")
    assert rc == 1
    c = checks["ram"]
    assert c["status"] == "fail"
    assert "available; the weight store needs" in c["detail"]
    assert "--base-quant" in c["fix"]
    assert {"ram", "ray"} <= failed(checks)  # Ray's object store cannot hold it either


def test_a_busy_port_fails_the_port_check():
    port = free_port()
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))
        s.listen()
        rc, checks = doctor_here("--metrics-port", str(port))
        text = CliRunner().invoke(main, ["doctor", "--metrics-port", str(port)])
    assert rc == 1 and failed(checks) == {"metrics_port"}
    assert checks["metrics_port"]["detail"] == f"port {port} is already in use"
    assert "--metrics-port" in checks["metrics_port"]["fix"]
    assert text.exit_code == 1
    assert f"fail  metrics_port  port {port} is already in use\n" in text.output
    assert "fix: pick another with --metrics-port, or leave it out" in text.output
    rc, checks = doctor_here("--metrics-port", str(port))  # released: fine again
    assert rc == 0 and checks["metrics_port"]["status"] == "ok"


def test_a_busy_default_port_is_a_warning_naming_the_port_train_will_take(monkeypatch):
    """Without --metrics-port train takes 8080 or the next free port, so a busy 8080 (another
    user's Ray on a shared box) does not stop a run: doctor failed it and exited 1, and told
    the operator to stop what holds it. It warns, and names the port train will serve on."""
    import appliance.metrics.endpoint as endpoint

    base = free_port()
    while not endpoint.port_is_free(base + 1):
        base = free_port()
    monkeypatch.setattr(doctor_module, "DEFAULT_METRICS_PORT", base)
    with socket.socket() as s:
        s.bind(("0.0.0.0", base))
        s.listen()
        c = check_port(None)
    assert (c.status, c.detail) == (
        "warn",
        f"port {base} is in use: train will serve metrics on {base + 1}, the next free one",
    )
    assert check_port(None).status == "ok"  # released


@pytest.mark.parametrize("port", ["70000", "-1", "0"])
def test_a_port_train_refuses_is_one_error_line_naming_the_flag(port):
    """70000 and -1 crashed in bind() with a traceback; 0 was "free" although train refuses it:
    doctor takes train's rule (1 to 65535), before any check runs."""
    out = CliRunner().invoke(main, ["doctor", "--metrics-port", port])
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit)
    assert out.output.splitlines() == [
        f"error: --metrics-port must be a TCP port, 1 to 65535 (got {port}): give a free one"
    ]
    c = check_port(int(port))  # the check itself, called with no flag parsing before it
    assert (c.status, c.detail) == ("fail", f"port {port} is not a TCP port (1 to 65535)")
    assert not port_is_free(int(port))
    cfg = TrainConfig(metrics_port=int(port))  # train's rule, the one doctor now follows
    assert any("--metrics-port must be a TCP port" in e for e in validate(cfg))


def test_a_small_shm_fails_the_shm_check(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with tempfile.TemporaryDirectory() as d:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", d])
        if mounted.returncode != 0:
            pytest.skip("mount -t tmpfs refused here")
        try:
            # the 1b preset's fp32 weight store is 4.6 GiB: far above 16 MiB
            monkeypatch.setenv("APPLIANCE_SHM_DIR", d)
            rc, checks = doctor_here("--preset", "1b", "--device", "cpu")
        finally:
            subprocess.run(["umount", d], check=True)
    assert rc == 1 and failed(checks) == {"shm"}
    c = checks["shm"]
    assert c["detail"].startswith(f"{d}: 16.0 MiB, 16.0 MiB free; the weight store needs 4.6 GiB")
    assert "--shm-size=" in c["fix"]


@pytest.mark.parametrize(
    "base_quant, smaller",
    [("none", "--base-quant int8|nf4"), ("int8", "--base-quant nf4"), ("nf4", None)],
)
def test_fixes_give_one_shm_size_and_only_smaller_quantizations(base_quant, smaller):
    """The shm, ram and ray fixes of one model name the same sizes (one /dev/shm in `g`, one RAM
    in GiB, from one function) and suggest only a --base-quant smaller than the one given."""
    from appliance.plan.doctor import check_ram, check_ray, check_shm, needs_for, suggested_sizes

    needs = needs_for(PRESETS["70b"].args, True, base_quant)
    huge = replace(needs, weight_store=2**50, ram=2**50 + needs.ram)  # more than any box here
    for n in (needs, huge):
        shm, ram = suggested_sizes(n)
        assert shm * 2**30 >= 1.1 * n.weight_store and ram * 2**30 >= 1.1 * n.ram
    shm, ram = suggested_sizes(huge)
    checks = {c.name: c for c in (check_shm(huge), check_ram(huge), check_ray(huge))}
    if any(c.status != "fail" for c in checks.values()):
        pytest.skip(f"no /dev/shm here: {checks}")
    assert f"--shm-size={shm}g " in checks["shm"].fix
    assert f"a box with {ram} GiB of RAM available" in checks["ram"].fix
    assert f"docker run --shm-size={shm}g on a box with {ram} GiB of RAM available" in (
        checks["ray"].fix
    )
    for c in checks.values():  # no other size in any fix
        assert set(re.findall(r"\d+(?:\.\d+)? ?(?:GiB|g)\b", c.fix)) <= {f"{shm}g", f"{ram} GiB"}
    for name in ("shm", "ram"):
        fix = checks[name].fix
        if smaller:
            assert f", or {smaller}" in fix
        else:
            assert "--base-quant" not in fix


def test_the_suggested_sizes_give_embedded_ray_a_store_that_holds_the_weights(monkeypatch):
    from appliance.cluster import start as cluster
    from appliance.config import TrainConfig
    from appliance.plan.doctor import needs_for, suggested_sizes

    needs = needs_for(PRESETS["70b"].args, True, "nf4")
    shm, ram = suggested_sizes(needs)
    monkeypatch.setattr(cluster, "shm_available_bytes", lambda _dir: shm * 2**30)
    monkeypatch.setattr(cluster, "ram_available_bytes", lambda: ram * 2**30)
    store, _ = cluster.object_store_bytes(TrainConfig())
    assert store >= needs.weight_store and ram * 2**30 >= needs.ram


def test_train_refuses_a_too_big_model_before_reading_weights(tmp_path):
    model = huge_model(tmp_path / "model")  # config.json only: reading a weight would fail
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    out = tmp_path / "out"
    argv = ["--model", str(model), "--data", str(data), "--output", str(out), "--device", "cpu"]
    p = CliRunner().invoke(main, ["train", *argv, "--log-format", "plain"])
    assert p.exit_code == 1
    lines = p.stderr.strip().splitlines()
    ram = [line for line in lines if line.startswith("error: ram: ")]
    assert len(ram) == 1 and "the weight store needs" in ram[0]  # and /dev/shm cannot hold it
    assert lines[-1] == f"error: (appliance doctor --model {model} checks the rest of this box)"
    assert "safetensors" not in p.output and isinstance(p.exception, SystemExit)
    assert not (out / "run.json").exists()  # nothing started, nothing written


def test_s3_model_checks_credentials_and_endpoint(s3_bucket, s3_client, s3_endpoint, monkeypatch):
    a = PRESETS["tiny"].args
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
    }
    s3_client.put_object(Bucket=s3_bucket, Key="m/config.json", Body=json.dumps(config).encode())
    uri = f"s3://{s3_bucket}/m"
    rc, checks = doctor_here("--model", uri, "--device", "cpu")
    assert checks["s3"] == {
        "name": "s3",
        "status": "ok",
        "detail": f"endpoint {s3_endpoint}: {uri}/config.json readable",
        "fix": "",
    }
    assert checks["disk"]["status"] == "ok" and "model cache" in checks["disk"]["detail"]
    assert "the weight store needs" in checks["shm"]["detail"]  # config.json was read from S3

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    rc, checks = doctor_here("--model", uri, "--device", "cpu")
    assert rc == 1 and "s3" in failed(checks)
    assert checks["s3"]["detail"] == f"no AWS credentials found (endpoint {s3_endpoint})"
    assert "AWS_ACCESS_KEY_ID" in checks["s3"]["fix"]


MOUNTS = """\
overlay / overlay rw,relatime,lowerdir=/l,upperdir=/u,workdir=/w 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=65536k 0 0
tmpfs /mnt/big\\040shm tmpfs rw,relatime,size=100g,huge=within_size 0 0
tmpfs /mnt/big\\040shm/inner tmpfs rw,huge=always 0 0
/dev/vda1 /mnt/big\\040shm/disk ext4 rw,relatime 0 0
"""


def test_the_huge_page_policy_is_the_mount_holding_the_path():
    from appliance.hardware.host import tmpfs_huge_policy

    plain = "always within_size advise [never] deny force"
    assert tmpfs_huge_policy(Path("/dev/shm"), MOUNTS, plain) == "never"  # not said: never
    assert tmpfs_huge_policy(Path("/mnt/big shm/x"), MOUNTS, plain) == "within_size"
    assert tmpfs_huge_policy(Path("/mnt/big shm/inner"), MOUNTS, plain) == "always"
    assert tmpfs_huge_policy(Path("/mnt/big shm/disk/y"), MOUNTS, plain) is None  # ext4
    assert tmpfs_huge_policy(Path("/srv"), MOUNTS, plain) is None  # the overlay root
    # the system-wide setting overrides every tmpfs's option when it denies or forces
    denied = "always within_size advise never [deny] force"
    assert tmpfs_huge_policy(Path("/mnt/big shm"), MOUNTS, denied) == "never"
    assert tmpfs_huge_policy(Path("/dev/shm"), MOUNTS, "never [force]") == "always"
    assert tmpfs_huge_policy(Path("/dev/shm"), MOUNTS, "") == "never"  # no sysfs file


@pytest.mark.parametrize("huge, status", [("never", "warn"), ("within_size", "ok")])
def test_shm_pages_reads_the_real_mount(monkeypatch, huge, status):
    from appliance.hardware.host import SHMEM_ENABLED

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        system = Path(SHMEM_ENABLED).read_text()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    if "[deny]" in system or "[force]" in system:
        pytest.skip(f"{SHMEM_ENABLED} overrides every mount here: {system.strip()}")
    with tempfile.TemporaryDirectory() as d:
        options = f"size=16m,huge={huge}"
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", d]).returncode != 0:
            pytest.skip(f"mount -t tmpfs -o {options} refused here")
        try:
            monkeypatch.setenv("APPLIANCE_SHM_DIR", d)
            rc, checks = doctor_here("--device", "cpu")
        finally:
            subprocess.run(["umount", d], check=True)
    c = checks["shm_pages"]
    assert c["status"] == status and f"{d}: tmpfs with huge={huge}" in c["detail"]
    assert ("huge=within_size" in c["fix"]) == (status == "warn")
    assert "shm_pages" not in failed(checks)  # slower, never a reason to refuse


@pytest.mark.parametrize("base_quant, status", [("nf4", "warn"), ("none", "ok")])
def test_quantizers_says_whether_the_c_kernels_are_built(monkeypatch, base_quant, status):
    """Built by this install (make test's, with a C compiler): ok, naming the library. Where the
    extension is missing (None in sys.modules makes its import fail, as an install without a
    compiler would), a quantized run is warned that it will load ~5x slower, and told how to
    build it; an unquantized run does not need it."""
    rc, checks = doctor_here("--device", "cpu", "--base-quant", base_quant)
    c = checks["quantizers"]
    assert c["status"] == "ok" and "fused C kernels built (_quantize." in c["detail"]
    assert "x86-64" in c["detail"] or platform.machine() != "x86_64"  # the ISA they run with
    monkeypatch.setitem(sys.modules, "appliance.quant._quantize", None)
    rc, checks = doctor_here("--device", "cpu", "--base-quant", base_quant)
    c = checks["quantizers"]
    assert c["status"] == status and "the fused C kernels are not built" in c["detail"]
    assert ("C compiler" in c["fix"]) == (status == "warn")
    assert "quantizers" not in failed(checks)


def test_triton_says_whether_a_gpu_box_can_build_its_kernels(monkeypatch):
    """No GPU: Triton is not used. A GPU box without a C compiler (a slim image): warned that
    the fused dequant falls back and torch.compile / flex_attention fail, and told what to
    install; never a failure. (On a GPU with a compiler the kernels launch:
    tests/quant/test_quant_gpu.py.)"""
    from appliance.plan.doctor import check_triton

    c = check_triton(cuda=False)
    assert (c.status, c.detail) == ("ok", "no CUDA GPU: Triton's kernels are not used")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    c = check_triton(cuda=True)
    assert c.status == "warn"
    assert c.detail.startswith("no C compiler (CC, cc, gcc, clang): Triton cannot build")
    assert "apt-get install gcc libc6-dev python3-dev" in c.fix
    _, checks = doctor_here("--device", "cpu")
    assert checks["triton"]["status"] == "ok" and "triton" not in failed(checks)
