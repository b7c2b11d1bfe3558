"""`appliance doctor`: what is wrong with this box, before a run finds out the slow way.

    appliance doctor                              # the box alone
    appliance doctor --model ./Llama-2-7b-hf      # and against this model's needs (config.json only)

Each check is ok / warn / fail with one line of detail and, unless ok, one line of fix; the exit
status is 1 when any check fails. With a model (or `--preset`), the memory checks compare this
box with what the run needs: the weight store (every block, in Ray's shared-memory object store,
in the compute dtype `--dtype auto` picks: trainer.resolve_dtype) and, on a GPU, the pages the
trainer page-locks (the store's blocks, registered in place).

`train` runs the cheap blocking checks (/dev/shm, RAM: `blocking_problems`) before it
loads anything, so a run that cannot fit fails in seconds with the same line.

The shared-memory directory is /dev/shm (where Ray's object store lives on Linux);
APPLIANCE_SHM_DIR points the check elsewhere (the tests use a small tmpfs).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.cluster.start import RAM_RESERVE_FRACTION, object_store_bytes, shm_gib_for
from appliance.config import DEFAULT_METRICS_PORT, TrainConfig
from appliance.errors import ApplianceError, ConfigError, first_line
from appliance.hardware.host import HUGE_POLICIES, tmpfs_huge_policy
from appliance.hardware.measure import (
    cgroup_memory_headroom,
    measure_bandwidth,
    measure_matmul,
    meminfo_available,
)
from appliance.metrics.endpoint import (
    default_candidates,
    is_tcp_port,
    port_is_free,
    port_range_error,
)
from appliance.models import param_count
from appliance.models.layers import ModelArgs
from appliance.plan import experts, full
from appliance.plan.estimate import (
    TOKENIZER_WORKER_BYTES,
    TOKENIZER_WORKERS,
    TRAINER_PROCESS_BYTES,
    block_bytes,
    globals_bytes,
    smaller_quants,
)
from appliance.plan.software import (  # noqa: F401 - check_triton: tests import it here
    Check,
    auto_dtype,
    check_gpus,
    check_python,
    check_quantizers,
    check_torch,
    check_triton,
)
from appliance.storage import localize as s3_cache
from appliance.storage import uri as storage

GiB, MiB = 2**30, 2**20
SHM_ENV = "APPLIANCE_SHM_DIR"
_TRAIN = TrainConfig()
# one trainer's tokens a step at train's default shape (doctor's --tokens-per-step default)
TRAIN_TOKENS_PER_STEP = _TRAIN.seq_len * _TRAIN.micro_batch_size * _TRAIN.micro_batches_per_step


@dataclass(frozen=True)
class Needs:
    """What a run of one model needs from this box (bytes)."""

    weight_store: int  # in /dev/shm, once per node
    page_locked: int  # per trainer process on a GPU (0 on the CPU)
    ram: int  # weight store + trainer + tokenizer processes (their sizes assumed)
    checkpoint: int  # the safetensors files, for a download (bf16 files assumed)
    base_quant: str = "none"  # what the weight store was counted in


def quant_hint(needs: Needs) -> str:
    """`, or --base-quant int8|nf4` (only the ones smaller than the current), or ""."""

    smaller = smaller_quants(needs.base_quant)
    return f", or --base-quant {'|'.join(smaller)}" if smaller else ""


def suggested_sizes(needs: Needs) -> tuple[int, int]:
    """(/dev/shm, available RAM), whole GiB, that hold this run: what every fix line suggests.

    Embedded Ray's object store takes what /dev/shm holds less a margin, at most 80 % of the RAM
    available (start.object_store_bytes); it must hold the weight store, and the RAM the whole
    run (`needs.ram`). Both with 10 % headroom."""

    store = needs.weight_store
    ram = 1.1 * max(needs.ram, store / (1 - RAM_RESERVE_FRACTION))
    return shm_gib_for(store), math.ceil(ram / GiB)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def needs_for(
    args: ModelArgs, cuda: bool, base_quant: str = "none", dtype_bytes: int | None = None
) -> Needs:
    """The host needs of training `args` here, by plan's own arithmetic (estimate.host_bytes);
    `dtype_bytes` defaults to the trainer's `--dtype auto` (trainer.resolve_dtype)."""

    if dtype_bytes is None:
        dtype_bytes = auto_dtype("cuda" if cuda else "cpu").itemsize
    block = block_bytes(args, dtype_bytes, base_quant)
    store = -(-globals_bytes(args, dtype_bytes) // 64) * 64 + args.num_layers * block
    ram = store + TRAINER_PROCESS_BYTES + TOKENIZER_WORKERS * TOKENIZER_WORKER_BYTES
    page_locked = args.num_layers * block if cuda else 0
    return Needs(store, page_locked, ram, param_count(args) * 2, base_quant)


# ---------------------------------------------------------------- the checks


def shm_dir() -> Path:
    return Path(os.environ.get(SHM_ENV) or "/dev/shm")


def check_shm(needs: Needs | None) -> Check:
    path = shm_dir()
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("shm", "fail", f"{path}: {e.strerror}", "mount a tmpfs there")
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{path}: {_gib(total)}, {_gib(free)} free"
    if needs is None:
        return Check("shm", "ok", detail + " (give --model to check it against a model)")
    detail += f"; the weight store needs {_gib(needs.weight_store)}"
    shm, _ = suggested_sizes(needs)
    fix = (
        f"give the container more shared memory: docker run --shm-size={shm}g "
        f"(Helm: the chart's shmSize), or a smaller model{quant_hint(needs)}"
    )
    if total < needs.weight_store:
        return Check("shm", "fail", detail, fix)
    if free < needs.weight_store:
        return Check("shm", "warn", detail + " (not free now)", "free /dev/shm (old Ray sessions?)")
    return Check("shm", "ok", detail)


def check_shm_pages() -> Check:
    """Whether the object store's shared memory comes in 2 MiB pages. With 4 KiB pages every
    process that writes the store (the weight store's load) takes a page fault per 4 KiB; with
    huge pages one per 2 MiB (docs/benchmarks.md, "NF4 codes by a table lookup": the 1B NF4
    load 0.41 s on 4 KiB pages, 0.26 s on 2 MiB pages; medians)."""
    path = shm_dir()
    policy = tmpfs_huge_policy(path)
    if policy is None:
        return Check("shm_pages", "ok", f"{path}: not a tmpfs (nothing to check)")
    if policy in HUGE_POLICIES:
        return Check("shm_pages", "ok", f"{path}: tmpfs with huge={policy} (2 MiB pages)")
    return Check(
        "shm_pages",
        "warn",
        f"{path}: tmpfs with huge={policy}: the weight store's load faults in its shared memory "
        "4 KiB at a time (slower to load; see docs/deploy.md, huge pages)",
        "on the host, mount a tmpfs with huge=within_size and give it to the container as "
        "/dev/shm (docker run -v HOSTDIR:/dev/shm; docker's --tmpfs refuses huge=)",
    )


def check_ram(needs: Needs | None) -> Check:

    host = meminfo_available()
    if host is None:
        return Check("ram", "warn", "cannot read /proc/meminfo", "")
    limit = cgroup_memory_headroom()
    limited = limit is not None and limit < host
    avail = limit if limited else host
    detail = f"{_gib(avail)} available"
    if limited:
        detail += f" under this container's memory limit (the host has {_gib(host)})"
    if needs is None:
        return Check("ram", "ok", detail)
    detail += (
        f"; the weight store needs {_gib(needs.weight_store)}, the whole run about "
        f"{_gib(needs.ram)}"
    )
    if avail < needs.weight_store:
        _, ram = suggested_sizes(needs)
        fix = (
            f"a memory limit of {ram} GiB (docker run --memory, the pod's limits.memory)"
            if limited
            else f"a box with {ram} GiB of RAM available"
        )
        return Check(
            "ram",
            "fail",
            detail,
            f"{fix}{quant_hint(needs)} (the OOM killer would end the run while it loads)",
        )
    if avail < needs.ram:
        return Check("ram", "warn", detail, "little room left: close other processes")
    return Check("ram", "ok", detail)


def check_memlock(needs: Needs | None) -> Check:
    """`ulimit -l`, for information: it never fails. The NVIDIA driver page-locks host memory
    (cudaHostRegister, cudaHostAlloc: its os_lock_user_pages pins with get_user_pages) without
    charging RLIMIT_MEMLOCK, so Docker's default 8 MiB (64 KiB on old kernels) and a Kubernetes
    pod, which cannot raise it, page-lock a 70B store all the same. mlock(2) and RDMA are what
    the limit bounds; the appliance uses neither."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else _gib(soft)
    detail = f"ulimit -l (memlock): {shown}"
    if needs is None or needs.page_locked == 0:
        why = "no model given" if needs is None else "nothing to page-lock on the CPU"
        return Check("memlock", "ok", f"{detail} ({why})")
    return Check(
        "memlock",
        "ok",
        f"{detail}; the GPU driver page-locks the blocks' {_gib(needs.page_locked)} without "
        "charging it (no --ulimit memlock needed)",
    )


def check_disk(model: str | None, needs: Needs | None) -> Check:
    if model is not None and storage.is_s3(model):
        root = s3_cache.cache_root()
        where = _existing(root)
        free = shutil.disk_usage(where).free
        detail = f"model cache {root}: {_gib(free)} free"
        if needs is not None:
            detail += f"; the checkpoint is about {_gib(needs.checkpoint)} (bf16 files)"
            if free < needs.checkpoint:
                return Check(
                    "disk",
                    "fail",
                    detail,
                    "free space there, or point APPLIANCE_S3_CACHE elsewhere",
                )
        return Check("disk", "ok", detail)
    where = _existing(Path.cwd())
    return Check("disk", "ok", f"{where}: {_gib(shutil.disk_usage(where).free)} free")


def _existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_speed() -> list[Check]:
    """Pinned host→device GB/s and matmul TFLOP/s in the compute dtype `--dtype auto` picks,
    on each GPU (a second or two each)."""
    import torch

    if not torch.cuda.is_available():
        return [Check("speed", "warn", "no GPU to measure", "")]
    out = []
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        b = measure_bandwidth(dev, 256 * MiB, reps=3)
        with torch.cuda.device(i):
            dtype = auto_dtype("cuda")
        p = measure_matmul(dev, dtype, 4096, 10)
        kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        detail = f"GPU {i}: pinned H2D {b / 1e9:.1f} GB/s, {kind} matmul {p / 1e12:.0f} TFLOP/s"
        if b < 10e9:
            out.append(
                Check(
                    f"speed{i}",
                    "warn",
                    detail,
                    "slow host link: check the slot (nvidia-smi -q | grep -A3 'Link Width')",
                )
            )
        else:
            out.append(Check(f"speed{i}", "ok", detail))
    return out


def check_port(port: int | None) -> Check:
    """The metrics port train would bind: `port` (--metrics-port) must be free, as train refuses
    one in use; with none given, train takes 8080 or the next free port, so a busy 8080 is only
    a warning (a Prometheus that scrapes 8080 would miss the run)."""

    if port is not None and not is_tcp_port(port):  # 0 would be any port, 65536 up none
        return Check(
            "metrics_port",
            "fail",
            f"port {port} is not a TCP port (1 to 65535)",
            "give --metrics-port a port from 1 to 65535, as train takes",
        )
    if port is not None:
        if port_is_free(port):
            return Check("metrics_port", "ok", f"port {port} is free")
        return Check(
            "metrics_port",
            "fail",
            f"port {port} is already in use",
            "pick another with --metrics-port, or leave it out to take the next free one",
        )
    ports = default_candidates(DEFAULT_METRICS_PORT)
    free = next((p for p in ports if port_is_free(p)), None)
    if free == DEFAULT_METRICS_PORT:
        return Check("metrics_port", "ok", f"port {free} is free")
    if free is None:
        return Check(
            "metrics_port",
            "fail",
            f"ports {ports.start}-{ports.stop - 1} are all in use",
            "pass a free one with --metrics-port",
        )
    return Check(
        "metrics_port",
        "warn",
        f"port {DEFAULT_METRICS_PORT} is in use: train will serve metrics on {free}, the next "
        "free one",
        f"point Prometheus at {free}, or free {DEFAULT_METRICS_PORT} for the run",
    )


def check_ray(needs: Needs | None) -> Check:
    """The object store embedded Ray gets here: what `appliance train` sizes it to
    (start.object_store_bytes: /dev/shm less a margin, at most 80% of the RAM available)."""

    cap, source = object_store_bytes(TrainConfig())
    if cap is None:
        return Check("ray", "ok", f"embedded Ray's object store: {source}")
    detail = f"embedded Ray's object store: {_gib(cap)} ({source})"
    if needs is None:
        return Check("ray", "ok", detail)
    detail += f"; the weight store needs {_gib(needs.weight_store)}"
    if cap < needs.weight_store:
        shm, ram = suggested_sizes(needs)
        return Check(
            "ray",
            "fail",
            detail,
            f"docker run --shm-size={shm}g on a box with {ram} GiB of RAM available, or set "
            "--object-store-memory (ray start --object-store-memory on a cluster)",
        )
    return Check("ray", "ok", detail)


def check_s3(model: str) -> Check:
    import boto3

    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS default"
    creds = boto3.Session().get_credentials()
    if creds is None:
        return Check(
            "s3",
            "fail",
            f"no AWS credentials found (endpoint {endpoint})",
            "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role",
        )
    try:
        storage.read_bytes(storage.join(model, "config.json"))
    except ApplianceError as e:
        return Check("s3", "fail", f"endpoint {endpoint}: {e}", "check the URI and credentials")
    return Check("s3", "ok", f"endpoint {endpoint}: {model}/config.json readable")


# ---------------------------------------------------------------- running them


def resolve_cuda(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def blocking_problems(
    args: ModelArgs, cuda: bool, base_quant: str = "none", dtype_bytes: int | None = None
) -> list[str]:
    """What stops a run of `args` on this box before it loads anything (/dev/shm, RAM):
    one line per failed check (detail, then fix); empty when none fails. `train` calls this."""
    needs = needs_for(args, cuda, base_quant, dtype_bytes)
    return [
        f"{c.name}: {c.detail}; {c.fix}"
        for c in (check_shm(needs), check_ram(needs))
        if c.status == "fail"
    ]


def run_checks(
    model: str | None = None,
    preset: str | None = None,
    base_quant: str = "none",
    device: str = "auto",
    metrics_port: int | None = None,
    tokens_per_step: int | None = None,
) -> list[Check]:
    """Every check, in order. Reads the model's config.json only. `tokens_per_step`: one
    trainer's tokens a step, for a mixture of experts' expected share of experts moved
    (default: train's shape)."""
    checks = [check_python(), check_torch(), check_gpus(device)]
    cuda = resolve_cuda(device)
    needs = None
    s3 = model is not None and storage.is_s3(model)
    if s3:
        checks.append(check_s3(model))
    if model is not None or preset is not None:
        from appliance.plan.estimate import load_args

        try:
            args, _ = load_args(model, preset)
            needs = needs_for(args, cuda, base_quant)
        except ApplianceError as e:
            checks.append(Check("model", "fail", first_line(e), "fix --model/--preset"))
        else:
            if args.num_experts:  # plan/experts.py: active parameters, experts expected to move
                tokens = tokens_per_step or TRAIN_TOKENS_PER_STEP
                checks.append(Check("moe", "ok", experts.doctor_line(args, base_quant, tokens)))
    checks += [
        check_shm(needs),
        check_shm_pages(),
        check_quantizers(base_quant),
        check_triton(cuda),
        check_ram(needs),
        check_memlock(needs),
        check_disk(model, needs),
        *check_speed(),
        Check("adamw", *full.adamw_check()),
        check_port(metrics_port),
        check_ray(needs),
    ]
    return checks


def format_checks(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<12}  {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"{'':<4}  {'':<12}  fix: {c.fix}")
    return "\n".join(lines)


def run_doctor(
    model: str | None,
    preset: str | None,
    base_quant: str,
    device: str,
    metrics_port: int | None,
    as_json: bool,
    tokens_per_step: int | None = None,
) -> int:
    """Print the checks; returns the exit status (1 when any check fails)."""
    if tokens_per_step is not None and tokens_per_step < 1:
        raise ConfigError(f"--tokens-per-step must be ≥ 1 (got {tokens_per_step})")
    if model is not None and preset is not None:
        raise ConfigError("give --model or --preset, not both")
    if base_quant not in ("none", "int8", "nf4"):
        raise ConfigError(f"--base-quant {base_quant!r} must be one of none | int8 | nf4")

    if metrics_port is not None and not is_tcp_port(metrics_port):  # train's rule, up front
        raise ConfigError(port_range_error(metrics_port))
    checks = run_checks(model, preset, base_quant, device, metrics_port, tokens_per_step)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(format_checks(checks))
    return 1 if failed else 0
