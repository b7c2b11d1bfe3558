"""Dequantizing one block on the GPU, timed against the block's matmuls (issue 13: < 5%).

    python benchmarks/dequant.py --json dequant.json             # CUDA: presets 7b and 70b
    python benchmarks/dequant.py --device cpu --json smoke.json  # CPU smoke test: tiny, PyTorch
    TRITON_INTERPRET=1 python benchmarks/dequant.py --device cpu  # + Triton's interpreter

A quantized base (--base-quant int8|nf4) is dequantized on the compute device once per block per
pass (streaming.DeviceWeights.get): once in the forward, once in the backward. This times that for
one block of a preset (its seven projections, q/k/v/o/gate/up/down, at the preset's shapes, from
random codes and scales: the time does not depend on their values) with each implementation:
`triton` (quant_gpu's fused kernels, what quant.dequantize uses on CUDA) and `pytorch` (reference.py's
functions, its fallback), and checks that the two give the same bits.

Against it, the block's matmul time at the preset's step shape (GPU: micro-batch 1 × seq 2048 ×
8 micro-batches), in the compute dtype: for each projection and micro-batch, the forward
`F.linear(x, W)` twice (the layer-major forward under no_grad, then the recompute with grad) and
the backward's `dY @ W` (the input's gradient; the base has no weight gradient). Attention, norms
and LoRA are left out, so the share below is an upper bound. Timed with CUDA events (warm-up
first, median of --reps); on a CPU with perf_counter.

    share = 2 · dequant / step matmuls    (per step; issue 13 asks < 5%)
    fwd share = dequant / forward pass's matmuls (8 × one F.linear per projection: the worst pass)

Needs only torch (and triton for the Triton column): no Ray or boto3. Prints a table and
writes JSON with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from appliance import models, quant
from appliance.hardware.measure import cuda_seconds
from appliance.models.presets import PRESETS
from appliance.quant import formats, reference

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def projections(preset: str) -> dict[str, tuple[int, int]]:
    """The shapes of a block's quantized weights (the linear projections) in a preset."""
    shapes = models.block_shapes(PRESETS[preset].args)
    return {n: tuple(s) for n, s in shapes.items() if quant.is_linear_weight(n)}


def random_quantized(
    shape: tuple[int, int], kind: str, device: torch.device, gen: torch.Generator
) -> quant.QuantizedTensor:
    """Codes and scales of `shape` quantized as `kind`, random, drawn on `device` from `gen`
    (a generator of that device: a 70B block's 0.9 G values drawn on one CPU core took longer
    than the benchmark's time limit on the GPU machine, 2026-11-27)."""
    n_codes, n_scales = formats._counts(shape, kind)
    if kind == "int8":
        codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8, device=device)
    else:
        codes = torch.randint(0, 256, (n_codes,), generator=gen, dtype=torch.uint8, device=device)
    scales = torch.rand(n_scales, generator=gen, device=device) * 0.05
    return quant.QuantizedTensor(kind, shape, codes, scales)


def timer(device: torch.device, reps: int, warmup: int):
    """median_ms(fn): fn's median time over `reps` calls after `warmup` untimed ones."""

    def median_ms(fn) -> float:
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            return 1e3 * statistics.median(cuda_seconds(fn, reps))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return median_ms


def triton_kernels(device: torch.device, dtype: torch.dtype):
    """quant_gpu where quant.dequantize uses it (else None, with the reason): on CUDA, what
    quant.gpu_dequantizers decides, after launching each kernel once (a Triton that imports but
    cannot compile or launch gives the PyTorch column alone, with its warning as the reason)."""
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernels = quant.gpu_dequantizers(device, dtype)
        if kernels is None:
            return None, str(caught[-1].message) if caught else f"none for {dtype}"
        return kernels, None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None, "not on CUDA"  # on a CPU only under Triton's interpreter (a smoke test)
    try:
        from appliance.quant import gpu as quant_gpu
    except Exception as e:  # noqa: BLE001 - any failure to import means: no Triton column
        return None, f"{type(e).__name__}: {e}"
    return quant_gpu, None


def dequant_fns(qs: dict[str, quant.QuantizedTensor], dtype: torch.dtype, kernels) -> dict:
    """implementation → a function dequantizing every weight of the block once."""

    def every_weight(impl):  # reference (PyTorch) or gpu (Triton): the same signatures
        return lambda: [
            impl.dequantize_int8(q.codes, q.scales, dtype)
            if q.kind == "int8"
            else impl.dequantize_nf4(q.codes, q.scales, q.shape, dtype)
            for q in qs.values()
        ]

    fns = {"pytorch": every_weight(reference)}
    if kernels is not None:
        fns["triton"] = every_weight(kernels)
    return fns


def matmul_ms(shapes, dtype, device, tokens, micro_batches, median_ms, gen) -> dict:
    """One block's projection matmuls for `micro_batches` micro-batches of `tokens` tokens: the
    forward (F.linear per projection) and the backward's input gradient (dY @ W), each timed
    over all micro-batches."""

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    ws = [randn(*s) * 0.02 for s in shapes.values()]
    xs = [randn(tokens, s[1]) for s in shapes.values()]
    dys = [randn(tokens, s[0]) for s in shapes.values()]

    def forward():
        for _ in range(micro_batches):
            for w, x in zip(ws, xs, strict=True):
                F.linear(x, w)

    def backward():
        for _ in range(micro_batches):
            for w, dy in zip(ws, dys, strict=True):
                torch.matmul(dy, w)

    fwd, bwd = median_ms(forward), median_ms(backward)
    return {"forward_pass_ms": fwd, "backward_dx_ms": bwd, "step_ms": 2 * fwd + bwd}


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return all(
        x.shape == y.shape
        and torch.equal(x.view(ints[x.dtype.itemsize]), y.view(ints[y.dtype.itemsize]))
        for x, y in zip(a, b, strict=True)
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--presets", help="comma-separated (default: 7b,70b on CUDA, tiny on CPU)")
    p.add_argument("--kinds", default="int8,nf4")
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--micro-batch-size", type=int, help="default: the preset's step shape")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batches", type=int)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    dtype = DTYPES[a.dtype]
    if not cuda:
        torch.set_num_threads(a.threads)
    presets = (a.presets or ("7b,70b" if cuda else "tiny")).split(",")
    kernels, no_triton = triton_kernels(device, dtype)
    median_ms = timer(device, a.reps, a.warmup)
    gen = torch.Generator(device).manual_seed(0)
    rows = []
    for name in presets:
        shape = PRESETS[name].gpu if cuda else (PRESETS[name].cpu or PRESETS[name].gpu)
        mbs = a.micro_batch_size or shape.micro_batch_size
        seq = a.seq_len or shape.seq_len
        mb = a.micro_batches or shape.micro_batches
        shapes = projections(name)
        mm = matmul_ms(shapes, dtype, device, mbs * seq, mb, median_ms, gen)
        for kind in a.kinds.split(","):
            qs = {n: random_quantized(s, kind, device, gen) for n, s in shapes.items()}
            fns = dequant_fns(qs, dtype, kernels)
            dq = {impl: median_ms(fn) for impl, fn in fns.items()}
            in_bytes = sum(q.nbytes for q in qs.values())
            out_bytes = sum(s[0] * s[1] for s in shapes.values()) * dtype.itemsize
            row = {
                "preset": name,
                "kind": kind,
                "tokens_per_micro_batch": mbs * seq,
                "micro_batches": mb,
                "weights": {n: list(s) for n, s in shapes.items()},
                "quantized_bytes": in_bytes,
                "dequantized_bytes": out_bytes,
                **mm,
                "dequant_ms": dq,
                # bytes read and written per second (a bound: HBM's bandwidth)
                "dequant_gb_per_s": {k: (in_bytes + out_bytes) / v / 1e6 for k, v in dq.items()},
                "share_of_step": {k: 2 * v / mm["step_ms"] for k, v in dq.items()},
                "share_of_forward_pass": {k: v / mm["forward_pass_ms"] for k, v in dq.items()},
            }
            if "triton" in fns:
                row["bitwise_equal"] = same_bits(fns["triton"](), fns["pytorch"]())
            rows.append(row)
            del qs, fns
            if cuda:
                torch.cuda.empty_cache()
    out = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "triton": kernels.triton.__version__ if kernels else None,
        "triton_unavailable": no_triton,
        "dtype": a.dtype,
        "reps": a.reps,
        "warmup": a.warmup,
        "rows": rows,
    }
    print(
        f"{out['device']}, {a.dtype}, median of {a.reps}; matmuls of one block for "
        f"{rows[0]['micro_batches'] if rows else '?'} micro-batches (forward twice + dY·W); "
        f"dequant of its 7 projections once per pass, twice per step"
        + (f"; no Triton ({no_triton})" if no_triton else "")
    )
    print(
        "| preset | kind | tokens/mb | step matmuls ms | dequant ms triton | dequant ms pytorch "
        "| share triton | share pytorch | fwd-pass share triton | equal |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        dq, sh, fw = r["dequant_ms"], r["share_of_step"], r["share_of_forward_pass"]

        def f(d, k, fmt):
            return format(d[k], fmt) if k in d else "-"

        print(
            f"| {r['preset']} | {r['kind']} | {r['tokens_per_micro_batch']} | {r['step_ms']:.2f} "
            f"| {f(dq, 'triton', '.3f')} | {f(dq, 'pytorch', '.3f')} | {f(sh, 'triton', '.1%')} "
            f"| {f(sh, 'pytorch', '.1%')} | {f(fw, 'triton', '.1%')} | {r.get('bitwise_equal', '-')} |"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
