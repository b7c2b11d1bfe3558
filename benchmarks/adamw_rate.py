"""AdamW on the host, in parameters per second: one transformer block of a preset (fp32 master
weights, gradients and two moments), each of torch's CPU implementations (docs/benchmarks.md,
"AdamW on the host").

    PYTHONPATH=$PWD python -m benchmarks.adamw_rate --preset 7b --json adamw-7b.json
    PYTHONPATH=$PWD python -m benchmarks.adamw_rate --preset tiny --threads 1     # seconds

A full fine-tune (--finetuning-type full) updates each block on the CPU with torch's AdamW
(engine/host_adam.py): `fused` (one vectorised kernel per tensor, torch ≥ 2.4: the engine's
default), `foreach` and `single` (torch's default for CPU tensors). This times one step of each
over the block's tensors at the preset's shapes (the step after the first, which allocates the
moments; the best of --reps), and checks that each gives the weights `single` gives to 1e-6
(the implementations round differently in the last bits; the engine's own exactness test is
tests/engine/test_full_finetune.py). Per core: the rate over the threads torch ran on.
"""

from __future__ import annotations

import argparse
import json

import torch

from appliance import models
from appliance.engine.host_adam import adamw, best_step_seconds
from appliance.hardware.measure import cpu_name
from appliance.models.presets import PRESETS

IMPLS = ("fused", "foreach", "single")


def one_block(preset: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = models.block_shapes(PRESETS[preset].args).values()
    return [torch.randn(tuple(s), generator=g) * 0.02 for s in shapes]


def time_impl(preset: str, impl: str, reps: int) -> tuple[float, list[torch.Tensor]]:
    """Best seconds of one AdamW step over one block, and the weights after reps + 1 steps."""
    params = one_block(preset)
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt = adamw(params, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, impl=impl)
    for group in opt.param_groups:
        group["lr"] = 1e-4
    return best_step_seconds(opt, reps), params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="7b", choices=list(PRESETS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    n = sum(p.numel() for p in one_block(a.preset))
    rows, reference = [], None
    for impl in IMPLS[::-1]:  # single first: the others are checked against it
        seconds, weights = time_impl(a.preset, impl, a.reps)
        if reference is None:
            reference = weights
        diff = max(float((w - r).abs().max()) for w, r in zip(weights, reference, strict=True))
        rows.append(
            {
                "impl": impl,
                "seconds": seconds,
                "params_per_second": n / seconds,
                "params_per_second_per_core": n / seconds / threads,
                "max_abs_diff_vs_single": diff,
            }
        )
    print(f"{a.preset}: one block, {n / 1e6:.1f} M parameters, {threads} threads, {cpu_name()}")
    print(f"{'impl':<8} {'s/step':>8} {'Mparam/s':>9} {'per core':>9} {'max |Δ| vs single':>18}")
    for r in rows[::-1]:
        print(
            f"{r['impl']:<8} {r['seconds']:>8.3f} {r['params_per_second'] / 1e6:>9.1f} "
            f"{r['params_per_second_per_core'] / 1e6:>9.1f} {r['max_abs_diff_vs_single']:>18.2e}"
        )
    if a.json:
        out = {"preset": a.preset, "params": n, "threads": threads, "cpu": cpu_name(),
               "torch": torch.__version__, "rows": rows[::-1]}  # fmt: skip
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
