"""quant_gpu, Triton's fused dequantizers: bit for bit reference.py's PyTorch path, and the dispatch.

Three ways, as the machine allows:

- Triton importable (not in CI): the kernels under Triton's interpreter (TRITON_INTERPRET=1, read
  when triton is imported, hence a subprocess) on CPU tensors, against the PyTorch functions, and
  `quant.dequantize` dispatching to them. APPLIANCE_TRITON_PYTHON names another interpreter with
  triton to run it from an environment without (e.g. `/work/venv-triton/bin/python`).
- A CUDA GPU with Triton (`-m gpu`): the same comparison compiled, on the device, and
  `quant.dequantize` of CUDA codes taking the Triton path.
- Always: with triton's import blocked, the dispatch warns once and dequantizes with PyTorch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from appliance import quant
from appliance.quant import QuantizedTensor, reference

ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _scales_with_ties() -> torch.Tensor:
    """fp32 scales whose products with ±1 are exact ties or edge cases of the rounding to bf16 and
    fp16 (nearest, ties to even), subnormal, zero, or past fp16's range."""
    bits = [0x3F808000, 0x3F818000, 0x3F80C000]  # bf16 ties: to 1.0 (even), to 1.015625; above
    values = [1 + 2**-11, 1 + 3 * 2**-11, 1e-6, 0.0, 1e-40, 1000.0, 1e36]  # fp16 ties; subnormal
    return torch.cat(
        [torch.tensor(bits, dtype=torch.int32).view(torch.float32), torch.tensor(values)]
    )


def cases() -> list[tuple[str, QuantizedTensor]]:
    """Quantized weights (CPU): from `quant.quantize` (odd shapes, a padded last NF4 block, zero
    rows and blocks, several Triton programs' worth) and made up (every code, edge-case scales)."""
    g = torch.Generator().manual_seed(0)
    out = []
    w = torch.randn(9, 70, generator=g)
    w[3] = 0  # a zero row
    big = torch.randn(41, 2067, generator=g).to(torch.bfloat16)  # 3 column programs, 42 nf4 ones
    for name, x in [("9x70", w), ("1x1", torch.randn(1, 1, generator=g)), ("41x2067", big)]:
        out.append((f"int8 {name}", quant.quantize(x, "int8")))
    zero_block = torch.randn(3, 64, generator=g)
    zero_block[1] = 0  # block 1 is all zeros
    padded = torch.randn(5, 37, generator=g)  # 185 values: 3 blocks, the last one padded
    for name, x in [("5x37", padded), ("3x64", zero_block), ("1x3", torch.randn(1, 3)), ("41x2067", big)]:  # fmt: skip
        out.append((f"nf4 {name}", quant.quantize(x, "nf4")))

    s = _scales_with_ties()
    codes = torch.randint(-128, 128, (len(s), 300), generator=g, dtype=torch.int8)
    codes[:, 0], codes[:, 1], codes[:, 2] = 1, -1, 127
    out.append(("int8 edge scales", QuantizedTensor("int8", tuple(codes.shape), codes, s)))
    nblocks = 2 * len(s)
    codes = torch.randint(0, 256, (nblocks * 32,), generator=g, dtype=torch.uint8)
    codes[:256] = torch.arange(256, dtype=torch.uint8)  # every byte: both nibbles of each
    absmax = torch.cat([s, torch.rand(len(s), generator=g)])
    shape = (3, (nblocks * 64 - 17) // 3)  # the last block padded
    out.append(("nf4 edge scales", QuantizedTensor("nf4", shape, codes, absmax)))
    return out


def _torch_path(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    if q.kind == "int8":
        return reference.dequantize_int8(q.codes, q.scales, dtype)
    return reference.dequantize_nf4(q.codes, q.scales, q.shape, dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def compare(device: str) -> dict:
    """Each case × dtype through quant_gpu's kernels and through `quant.dequantize` (on `device`,
    which must dispatch to quant_gpu there), against the PyTorch path: the mismatches, by name."""
    from appliance.quant import gpu as quant_gpu

    calls = []
    kernels = {k: getattr(quant_gpu, k) for k in ("dequantize_int8", "dequantize_nf4")}

    def spy(name):
        def call(*args):
            calls.append(name)
            return kernels[name](*args)

        return call

    bad, checked = [], 0
    for name, q in cases():
        q = q.to(device)
        for dtype in DTYPES:
            ref = _torch_path(q, dtype)
            if q.kind == "int8":
                got = quant_gpu.dequantize_int8(q.codes, q.scales, dtype)
            else:
                got = quant_gpu.dequantize_nf4(q.codes, q.scales, q.shape, dtype)
            with pytest.MonkeyPatch.context() as mp:
                for k in kernels:
                    mp.setattr(quant_gpu, k, spy(k))
                dispatched = quant.dequantize(q, dtype)
            checked += 1
            if not _same_bits(ref, got):
                bad.append(f"{name} {dtype}: kernel")
            if not _same_bits(ref, dispatched):
                bad.append(f"{name} {dtype}: dequantize")
    return {"checked": checked, "bad": bad, "dispatched": len(calls)}


def _triton_python() -> str | None:
    """An interpreter that imports triton: $APPLIANCE_TRITON_PYTHON, or this one if it does."""
    if os.environ.get("APPLIANCE_TRITON_PYTHON"):
        return os.environ["APPLIANCE_TRITON_PYTHON"]
    return sys.executable if importlib.util.find_spec("triton") else None


def test_kernels_equal_the_pytorch_path_under_the_interpreter():
    python = _triton_python()
    if python is None:
        pytest.skip("triton is not installed here (as in CI); set APPLIANCE_TRITON_PYTHON to run")
    script = (
        "import json, sys; from appliance.quant import reference; "
        "reference._GPU_DEVICES = ('cpu',); "  # dequantize of CPU codes takes the Triton path
        "from tests.quant.test_quant_gpu import compare; print(json.dumps(compare('cpu')))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [python, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["bad"] == []
    assert result["checked"] == len(cases()) * len(DTYPES)
    assert result["dispatched"] == result["checked"]  # every dequantize went to the kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_doctor_finds_the_triton_kernels_launch_on_this_gpu():
    pytest.importorskip("triton", reason="this CUDA torch comes without triton")
    from appliance.plan.doctor import check_triton

    c = check_triton(cuda=True)
    assert c.status == "ok", c.detail
    assert c.detail.startswith("fused dequant kernels launch (C compiler: ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_equal_the_pytorch_path_on_cuda():
    pytest.importorskip("triton", reason="this CUDA torch comes without triton")
    from appliance.quant import gpu as quant_gpu

    assert reference._gpu_kernels() is quant_gpu
    result = compare("cuda")
    assert result["bad"] == []
    assert result["dispatched"] == result["checked"] == len(cases()) * len(DTYPES)
    # the weights of a real block's shape (7B's down_proj), beyond the small cases
    w = torch.randn(4096, 11008, dtype=torch.bfloat16, device="cuda")
    for kind in ("int8", "nf4"):
        q = quant.quantize(w, kind).to("cuda")
        assert _same_bits(quant.dequantize(q, torch.bfloat16), _torch_path(q, torch.bfloat16))


def test_without_triton_dequantize_warns_once_and_uses_pytorch(monkeypatch):
    """triton's import blocked (as on a GPU image without it): one warning naming the cause, then
    the PyTorch path, equal values, no error."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "appliance.quant.gpu", raising=False)
    monkeypatch.setattr(reference, "_GPU_DEVICES", ("cpu",))  # take the GPU branch with CPU codes
    reference._gpu_kernels.cache_clear()
    try:
        for n, (name, q) in enumerate(cases()):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = quant.dequantize(q, torch.bfloat16)
            messages = [str(w.message) for w in caught]
            if n == 0:
                assert len(messages) == 1 and "Triton's GPU kernels unavailable" in messages[0]
                assert "triton" in messages[0] and "dequantizing with PyTorch" in messages[0]
            else:
                assert messages == []  # the import is tried once
            assert _same_bits(got, _torch_path(q, torch.bfloat16)), name
        assert reference._gpu_kernels() is None
    finally:
        reference._gpu_kernels.cache_clear()  # the next test imports triton afresh, where it can


@contextlib.contextmanager
def stand_in_kernels(monkeypatch, launch):
    """quant_gpu replaced by a module whose two kernels are `launch` (args as quant_gpu's, the
    dtype last), on a CPU that takes the GPU branch, loaded afresh: as Triton kernels that compile
    or fail at their first launch would be on a GPU."""
    import types

    stand_in = types.ModuleType("appliance.quant.gpu")
    stand_in.dequantize_int8 = stand_in.dequantize_nf4 = launch
    monkeypatch.setitem(sys.modules, "appliance.quant.gpu", stand_in)
    monkeypatch.setattr(reference, "_probe_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(reference, "_GPU_DEVICES", ("cpu",))  # take the GPU branch with CPU codes
    reference._gpu_kernels.cache_clear()
    try:
        yield
    finally:
        reference._gpu_kernels.cache_clear()


def dequantize_warning(q: QuantizedTensor) -> tuple[torch.Tensor, list[str]]:
    """A bfloat16 dequantize of q (the first loads the kernels) and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = quant.dequantize(q, torch.bfloat16)
    return got, [str(w.message) for w in caught]


def test_kernels_that_fail_at_their_first_launch_fall_back_before_the_first_step(monkeypatch):
    """Triton compiles at a kernel's first launch, not at import (a missing C compiler, an
    unwritable cache, a GPU its ptxas does not know): the dispatch launches both kernels once when
    it first loads them, and a failure there warns and takes the PyTorch path, rather than
    raising inside a training step. (The GPU is stood in for by the CPU and the kernels by a
    module whose launches fail, as they would.)"""
    launched = []

    def failing(*args):
        launched.append(args[-1])
        raise RuntimeError("ptxas fatal: Value 'sm_120' is not defined for option 'gpu-name'")

    with stand_in_kernels(monkeypatch, failing):
        name, q = cases()[0]
        got, messages = dequantize_warning(q)
        assert len(messages) == 1 and "Triton's GPU kernels unavailable" in messages[0]
        assert "ptxas fatal" in messages[0] and "dequantizing with PyTorch" in messages[0]
        assert launched == [torch.bfloat16]  # the probe's int8 launch, before any step's
        assert _same_bits(got, _torch_path(q, torch.bfloat16)), name


def test_the_first_launch_probes_every_dtype_the_kernels_are_used_for(monkeypatch):
    """Triton compiles one kernel per output dtype: a kernel that compiles in bfloat16 but not in
    float16 falls back when the kernels are first loaded (a warning, the PyTorch path), not at the
    first float16 step's dequantize. (CPU and a stand-in module for the GPU, as above.)"""
    launched = []

    def fails_in_float16(*args):
        launched.append(args[-1])
        if args[-1] == torch.float16:
            raise RuntimeError("triton: unsupported conversion to fp16 on this target")
        return None

    with stand_in_kernels(monkeypatch, fails_in_float16):
        name, q = cases()[0]
        got, messages = dequantize_warning(q)  # a bfloat16 step loads the kernels
        assert len(messages) == 1 and "unsupported conversion to fp16" in messages[0]
        assert launched == [torch.bfloat16, torch.bfloat16, torch.float16]  # int8, nf4, int8
        assert quant.gpu_dequantizers(torch.device("cpu"), torch.float16) is None
        assert _same_bits(got, _torch_path(q, torch.bfloat16)), name


def test_dequant_benchmark_runs_on_a_cpu_and_writes_json(tmp_path):
    """benchmarks/dequant.py's CPU path (tiny, PyTorch only): a table and JSON, and none of Ray,
    boto3 imported (the script must run on a bare GPU image)."""
    out = tmp_path / "dequant.json"
    script = (
        "import runpy, sys; "
        f"sys.argv = ['dequant.py', '--device', 'cpu', '--reps', '2', '--json', {str(out)!r}]; "
        "runpy.run_path('benchmarks/dequant.py', run_name='__main__'); "
        "print('imported:', [m for m in ('ray', 'boto3') if m in sys.modules])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "| tiny | int8 |" in run.stdout and "| tiny | nf4 |" in run.stdout
    assert "imported: []" in run.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["triton_unavailable"] == "not on CUDA"
    assert [(r["preset"], r["kind"]) for r in result["rows"]] == [("tiny", "int8"), ("tiny", "nf4")]
    for r in result["rows"]:
        assert len(r["weights"]) == 7  # q, k, v, o, gate, up, down
        assert r["dequant_ms"]["pytorch"] > 0 and r["step_ms"] > 0
        assert r["share_of_step"]["pytorch"] == 2 * r["dequant_ms"]["pytorch"] / r["step_ms"]
        assert r["step_ms"] == 2 * r["forward_pass_ms"] + r["backward_dx_ms"]
