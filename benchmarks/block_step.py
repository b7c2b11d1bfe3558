"""One transformer block of the streamed step, timed on its own: forward + recompute/backward.

    python benchmarks/block_step.py                      # hidden 1024, seq 512, 1 thread, CPU
    python benchmarks/block_step.py --threads 2 --json block.json

The streamed step runs each block twice per micro-batch: once forward under no_grad (the
layer-major forward), once recomputed with grad and backpropagated (the backward). This times
exactly those two calls of `models.block_forward` for each family at one shape, with LoRA r16 on
every projection (fp32 adapters cast to the compute dtype, as the engine does), so a change to the
block math (norms, RoPE, LoRA, SiLU·up) shows up here without the rest of the step. The `appliance`
package that is imported is the one timed: run it from two checkouts to compare them
(docs/benchmarks.md gives the commands). Prints a table of medians (ms) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from appliance import model as M
from appliance import models
from appliance.lora import LoraSpec, LoraWeights

# family → ModelArgs fields beyond the shared shape (the features whose math differs)
FAMILIES = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "llama+dropout": dict(architecture="LlamaForCausalLM"),  # LoRA dropout 0.1
    "qwen3": dict(architecture="Qwen3ForCausalLM", qk_norm=True),
    "gemma3": dict(
        architecture="Gemma3ForCausalLM", qk_norm=True, norm_offset=1.0, attn_scale=64**-0.5
    ),
    "phi3": dict(architecture="Phi3ForCausalLM", partial_rotary_factor=0.75),
}


def block_args(family: str, hidden: int, heads: int, kv_heads: int) -> M.ModelArgs:
    return M.ModelArgs(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,  # Llama's ratio (2816 for 1024)
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        **FAMILIES[family],
    )


def time_block(args: M.ModelArgs, dropout: float, batch: int, seq: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    w = {
        name: torch.randn(shape, generator=gen) * (0.02 if len(shape) == 2 else 1.0)
        for name, shape in models.block_shapes(args).items()
    }
    lora = LoraWeights(args, LoraSpec(rank=16, alpha=32.0, dropout=dropout))
    with torch.no_grad():
        for _, B in lora.blocks[0].values():
            B.normal_(0, 0.02, generator=gen)  # B = 0 would make LoRA's contribution trivial
    cos, sin = M.rope_cos_sin(args, seq, torch.device("cpu"), torch.float32)
    x = torch.randn(batch, seq, args.hidden_size, generator=gen)
    grad_out = torch.randn(batch, seq, args.hidden_size, generator=gen)

    def forward() -> None:
        with torch.no_grad():
            ctx = lora.context(0, torch.float32)
            ctx.generator = torch.Generator().manual_seed(1)
            models.block_forward(x, w, args, cos, sin, ctx)

    def backward() -> None:
        ctx = lora.context(0, torch.float32)
        ctx.generator = torch.Generator().manual_seed(1)
        xg = x.detach().requires_grad_(True)
        models.block_forward(xg, w, args, cos, sin, ctx).backward(grad_out)
        for p in lora.parameters():
            p.grad = None

    for _ in range(2):  # warm-up: first calls allocate and pick kernels
        forward()
        backward()
    fwd, bwd = [], []
    for _ in range(reps):  # alternate, so a change in machine load hits both alike
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return {
        "forward_ms": 1e3 * statistics.median(fwd),
        "recompute_backward_ms": 1e3 * statistics.median(bwd),
        "forward_ms_min": 1e3 * min(fwd),
        "recompute_backward_ms_min": 1e3 * min(bwd),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = {}
    for fam in a.families.split(","):
        args = block_args(fam, a.hidden, a.heads, a.kv_heads)
        rows[fam] = time_block(args, 0.1 if "dropout" in fam else 0.0, a.batch, a.seq, a.reps)
    print(
        f"hidden {a.hidden}, heads {a.heads}/{a.kv_heads}, batch {a.batch} × seq {a.seq}, "
        f"LoRA r16 on every projection, fp32, {a.threads} thread(s), median of {a.reps}"
    )
    print("| block | forward ms | recompute+backward ms |\n|---|---:|---:|")
    for fam, r in rows.items():
        print(f"| {fam} | {r['forward_ms']:.1f} | {r['recompute_backward_ms']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": vars(a), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
