"""One transformer block of the streamed step, timed on its own: forward + recompute/backward.

    python benchmarks/block_step.py                      # hidden 1024, seq 512, 1 thread, CPU
    python benchmarks/block_step.py --threads 2 --json block.json
    python benchmarks/block_step.py --device cuda --dtype bfloat16 --hidden 4096 --heads 32 \
        --seq 2048 --compile --families llama,llama+dropout    # 7B's block: eager vs compiled

The streamed step runs each block twice per micro-batch: once forward under no_grad (the
layer-major forward), once recomputed with grad and backpropagated (the backward). This times
exactly those two calls of `models.block_forward` for each family at one shape, with LoRA r16 on
every projection (fp32 adapters cast to the compute dtype, as the engine does), so a change to the
block math (norms, RoPE, LoRA, SiLU·up) shows up here without the rest of the step. The `appliance`
package that is imported is the one timed: run it from two checkouts to compare them
(docs/benchmarks.md gives the commands). Prints a table of medians (ms) and writes JSON.

`--compile` adds a row per family for the engine's compiled block
(`models.compiled_block_forward`, `train --compile-blocks`: Inductor fuses the block's
elementwise work into generated kernels), beside the eager block (the fused primitives:
F.rms_norm, in-place SiLU·up, ...): the measurement issue 10 asks for to choose between them on
a GPU. Each compiled row also gives its largest difference from the eager block (forward output,
LoRA gradients), the seconds its first calls took to compile, and the graph breaks Dynamo made in
them (each one would split the block into separately compiled pieces with eager PyTorch between
them; LoRA dropout's masks are drawn outside the block, so there should be none).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

from appliance import models
from appliance.models import layers, rope
from appliance.models.lora import LoraSpec, LoraWeights

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


class OpCount(TorchDispatchMode):
    """Counts the ATen operators dispatched under it (views included: each costs the host a
    dispatch), the host's work per micro-batch that a launch-bound GPU waits for; `kernels`
    leaves out the views (an operator whose output aliases its input: view, t, slice, split,
    expand, detach, ...), which launch nothing on a GPU."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        returns = func._schema.returns
        aliases = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        if not aliases and func.name() not in _VIEW_LISTS:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


# views whose schema returns a list of aliases, which `alias_info` does not mark
_VIEW_LISTS = {"aten::split_with_sizes", "aten::split.Tensor", "aten::unbind.int"}


def block_args(family: str, hidden: int, heads: int, kv_heads: int) -> layers.ModelArgs:
    return layers.ModelArgs(
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


def time_block(
    args: layers.ModelArgs,
    dropout: float,
    batch: int,
    seq: int,
    reps: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    compile_block: bool = False,
    kernels: str = "exact",
) -> dict:
    """Median ms of the block's no-grad forward and of its recompute + backward, eager (the
    fused primitives) or `torch.compile`d; a compiled row also has its largest difference from
    the eager block and its compile seconds."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    w = {
        name: (torch.randn(shape, generator=gen) * (0.02 if len(shape) == 2 else 1.0)).to(
            dev, dtype
        )
        for name, shape in models.block_shapes(args).items()
    }
    lora = LoraWeights(args, LoraSpec(rank=16, alpha=32.0, dropout=dropout), device=dev)
    with torch.no_grad():
        for _, B in lora.blocks[0].values():
            B.copy_(torch.randn(B.shape, generator=gen) * 0.02)  # B = 0: LoRA would add nothing
    cos, sin = rope.rope_cos_sin(args, seq, dev, dtype)
    x = torch.randn(batch, seq, args.hidden_size, generator=gen).to(dev, dtype)
    grad_out = torch.randn(batch, seq, args.hidden_size, generator=gen).to(dev, dtype)
    block = None
    if compile_block:
        block = models.compiled_block_forward
        # each row compiles from empty caches, as one `train` process of one model does: after
        # another row's graphs, Dynamo would recompile with dynamic shapes (slower kernels, and
        # compile seconds that are not this row's)
        torch._dynamo.reset()

    def context() -> layers.LoraContext:
        # exact: asked as a checkout from before the tiers would (this bench compares checkouts)
        ctx = lora.context(0, dtype, **({} if kernels == "exact" else {"kernels": kernels}))
        ctx.generator = torch.Generator(dev).manual_seed(1)  # the same masks every call
        return ctx

    def forward(fn=models.block_forward, ops: OpCount | None = None) -> torch.Tensor:
        ctx = context()  # made once per block and pass in the engine, for all its micro-batches
        with torch.no_grad(), ops or contextlib.nullcontext():
            return fn(x, w, args, cos, sin, ctx)

    def backward(
        fn=models.block_forward, ops: OpCount | None = None, keep: bool = False
    ) -> list[torch.Tensor]:
        xg = x.detach().requires_grad_(True)
        ctx = context()
        with ops or contextlib.nullcontext():
            fn(xg, w, args, cos, sin, ctx).backward(grad_out)
        grads = [p.grad for p in lora.parameters()]
        for p in lora.parameters() if not keep else ():
            p.grad = None
        return grads

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    row: dict = {"impl": "compiled" if block else "eager"}
    if block is None:  # what the host dispatches for one micro-batch through the block
        forward(ops=(fwd_ops := OpCount()))
        # counted: a micro-batch after the step's first, whose LoRA gradients add to the
        # first's (the first's are kept, where its casts' backward would have begun them)
        backward(keep=True)
        backward(ops=(bwd_ops := OpCount()))
        row["forward_ops"], row["recompute_backward_ops"] = fwd_ops.total, bwd_ops.total
        row["forward_kernels"] = fwd_ops.kernels
        row["recompute_backward_kernels"] = bwd_ops.kernels
    if block is not None:
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        t0 = time.perf_counter()
        y, grads = forward(block), backward(block)
        sync()
        row["compile_seconds"] = time.perf_counter() - t0
        row["graph_breaks"] = sum(counters["graph_break"].values()) - breaks
        y_ref, grads_ref = forward(), backward()
        row["max_abs_diff_output"] = (y.float() - y_ref.float()).abs().max().item()
        row["max_abs_diff_lora_grad"] = max(
            (g.float() - r.float()).abs().max().item()
            for g, r in zip(grads, grads_ref, strict=True)
        )
    fn = block or models.block_forward
    for _ in range(2):  # warm-up: first calls allocate and pick kernels
        forward(fn)
        backward(fn)
    fwd, bwd = [], []
    for _ in range(reps):  # alternate, so a change in machine load hits both alike
        sync()
        t0 = time.perf_counter()
        forward(fn)
        sync()
        t1 = time.perf_counter()
        backward(fn)
        sync()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return {
        **row,
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
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the block")
    p.add_argument(
        "--kernels", default="exact", choices=["exact", "fast"],
        help="the LoRA kernels' tier (train --kernels): fast stacks the shared-input A's",
    )  # fmt: skip
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    rows = {}

    def write_json() -> None:  # after every row: a later row's crash keeps the earlier ones
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"shape": vars(a), "rows": rows}, f, indent=2)

    for fam in a.families.split(","):
        args = block_args(fam, a.hidden, a.heads, a.kv_heads)
        for compiled in (False, True) if a.compile else (False,):
            name = fam + (" compiled" if compiled else "")
            try:
                rows[name] = time_block(
                    args, 0.1 if "dropout" in fam else 0.0, a.batch, a.seq, a.reps,
                    a.device, dtype, compiled, a.kernels,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - e.g. no C compiler or Python.h for Triton
                if not compiled:
                    raise  # the eager block failing is a bug, not a missing compiler
                rows[name] = {"impl": "compiled", "error": f"{type(e).__name__}: {e}"[:2000]}
            write_json()
    print(
        f"hidden {a.hidden}, heads {a.heads}/{a.kv_heads}, batch {a.batch} × seq {a.seq}, "
        f"LoRA r16 on every projection, {a.dtype} on {a.device}, {a.threads} thread(s), "
        f"median of {a.reps}"
    )
    print(
        "| block | forward ms | recompute+backward ms | ATen ops (forward; recompute+backward) "
        "| of them kernels | compile s | graph breaks | max diff (out; LoRA grad) |\n"
        "|---|---:|---:|---|---|---:|---:|---|"
    )
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error'].splitlines()[0][:200]} | | | | | | |")
            continue
        diff = (
            f"{r['max_abs_diff_output']:.1e}; {r['max_abs_diff_lora_grad']:.1e}"
            if "compile_seconds" in r
            else ""
        )
        ops = f"{r['forward_ops']}; {r['recompute_backward_ops']}" if "forward_ops" in r else ""
        kern = (
            f"{r['forward_kernels']}; {r['recompute_backward_kernels']}"
            if "forward_kernels" in r
            else ""
        )
        print(
            f"| {name} | {r['forward_ms']:.1f} | {r['recompute_backward_ms']:.1f} | {ops} | {kern} | "
            f"{format(r['compile_seconds'], '.1f') if 'compile_seconds' in r else ''} | "
            f"{r.get('graph_breaks', '')} | {diff} |"
        )


if __name__ == "__main__":
    main()
