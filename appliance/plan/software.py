"""The box's software and devices, for `appliance doctor` (plan/doctor.py runs these among its
checks): Python, torch and the driver, the GPUs, the fused C quantizers, Triton. `Check` is one
check's result, shared by every doctor check."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance.actors.trainer import resolve_dtype
from appliance.engine.blocks import dtype_from_name
from appliance.hardware.gpu_monitor import _import_pynvml
from appliance.quant import reference

GiB = 2**30
MIN_PYTHON = (3, 10)


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def auto_dtype(device: str):
    """The torch dtype `--dtype auto` trains in on `device` (cpu | cuda; a GPU: the current one)."""

    return dtype_from_name(resolve_dtype("auto", device))


def check_python() -> Check:
    v = sys.version_info
    ok = v[:2] >= MIN_PYTHON
    return Check(
        "python",
        "ok" if ok else "fail",
        f"Python {platform.python_version()} ({sys.executable})",
        "" if ok else f"use Python ≥ {'.'.join(map(str, MIN_PYTHON))}",
    )


def check_torch() -> Check:
    import torch

    cuda = torch.version.cuda
    driver = _driver_version()
    detail = f"torch {torch.__version__}, CUDA {cuda or 'none (a CPU build)'}"
    if driver:
        detail += f", driver {driver}"
    if cuda is None:
        return Check("torch", "warn", detail, "install a CUDA build of torch to train on a GPU")
    if not torch.cuda.is_available():
        return Check(
            "torch",
            "warn",
            detail + "; CUDA not usable here",
            "check the driver (nvidia-smi) and that the container sees the GPU (--gpus all)",
        )
    return Check("torch", "ok", detail)


def _driver_version() -> str | None:

    pynvml = _import_pynvml()
    if pynvml is None:
        return None
    try:
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # no driver, no NVML: nothing to report
        return None


def check_gpus(device: str) -> Check:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        if device == "cuda":
            return Check(
                "gpus", "fail", "--device cuda, but no GPU is visible", "use --device cpu or auto"
            )
        return Check(
            "gpus",
            "warn",
            "no GPU visible: training runs on the CPU (fp32; slow beyond tiny models)",
            "run on a GPU box (docker run --gpus all ...)",
        )
    parts, no_bf16 = [], []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        with torch.cuda.device(i):
            bf16 = auto_dtype("cuda") == torch.bfloat16  # Ampere and newer: bf16 tensor cores
        parts.append(f"{i}: {p.name} {p.total_memory / GiB:.1f} GiB{'' if bf16 else ' (no bf16)'}")
        if not bf16:
            no_bf16.append(str(i))
    if no_bf16:
        return Check(
            "gpus",
            "warn",
            "; ".join(parts),
            f"GPU {','.join(no_bf16)} has no bf16: --dtype auto trains in float16 with loss "
            "scaling there (an Ampere+ card has bf16's range)",
        )
    return Check("gpus", "ok", "; ".join(parts))


def check_quantizers(base_quant: str) -> Check:
    """Whether the fused C quantizers (appliance/quant/_quantize.c) were built at install: without them
    --base-quant int8|nf4 codes the same values with PyTorch, ~5x slower to load."""
    import importlib

    try:
        ext = importlib.import_module("appliance.quant._quantize")
    except ImportError as e:
        detail = f"the fused C kernels are not built ({e})"
        if base_quant == "none":
            return Check("quantizers", "ok", detail + "; only --base-quant int8|nf4 uses them")
        return Check(
            "quantizers",
            "warn",
            detail + f": --base-quant {base_quant} quantizes with PyTorch, ~5x slower to load",
            "reinstall the appliance where a C compiler and Python's headers are present "
            "(e.g. apt-get install gcc python3-dev; pip install --force-reinstall --no-deps .)",
        )
    return Check(
        "quantizers", "ok", f"fused C kernels built ({Path(ext.__file__).name}, {ext.isa()})"
    )


def check_triton(cuda: bool) -> Check:
    """On a GPU: whether Triton's kernels launch here. Triton builds each kernel's launcher with
    the system C compiler (`CC`, else cc/gcc/clang) at its first launch; without one the fused
    dequant of --base-quant falls back to PyTorch (slower, said only in the trainer's log), and
    torch.compile and the packed rows' flex_attention fail."""
    if not cuda:
        return Check("triton", "ok", "no CUDA GPU: Triton's kernels are not used")
    compiler = os.environ.get("CC") or next(
        (c for c in ("cc", "gcc", "clang") if shutil.which(c)), None
    )
    if compiler is None:
        return Check(
            "triton",
            "warn",
            "no C compiler (CC, cc, gcc, clang): Triton cannot build its kernels' launchers, so "
            "the fused dequant runs as PyTorch and torch.compile / flex_attention fail",
            "install one (apt-get install gcc libc6-dev python3-dev; the appliance image has it)",
        )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = reference._gpu_kernels() is not None
    if not ok:
        why = str(caught[-1].message) if caught else "Triton's kernels did not launch"
        return Check("triton", "warn", why, "check the Triton install against this torch")
    return Check("triton", "ok", f"fused dequant kernels launch (C compiler: {compiler})")
