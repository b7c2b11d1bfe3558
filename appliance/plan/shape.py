"""The micro-batch's shape for a GPU: more rows a micro-batch, fewer micro-batches a step, the
same tokens a step.

A GPU issues one set of kernels per block and micro-batch; at train's default (4 rows × 256
tokens) the kernels are too small to keep a large GPU busy (H100, 7B: about half of it idled,
docs/benchmarks.md). So where the user left `--micro-batch-size` at train's default and the
plan is for a GPU, the rows a micro-batch grow by a factor k that divides the micro-batches a
step (rows × k, M / k: the tokens a step do not change, nor the sequence length) until a
micro-batch holds at least GPU_MICRO_BATCH_TOKENS tokens. It stops before the plan gets worse:
the first k under which the plan no longer fits the GPU, keeps fewer blocks resident, or starts
offloading the saved activations is not taken (each step of k's only cost is the working set
of one micro-batch through one block, which grows with it). On a CPU nothing changes.
"""

from __future__ import annotations

from dataclasses import replace

from appliance.plan.estimate import PlanInput, evaluate

#: tokens a micro-batch at least, on a GPU (rows × seq_len), where memory allows
GPU_MICRO_BATCH_TOKENS = 4096


def gpu_micro_batch(p: PlanInput, micro_batches: int) -> tuple[int, int, str]:
    """(rows a micro-batch, micro-batches a step, why) for `p` on its GPU at `micro_batches`
    micro-batches of `p.micro_batch_size` rows (see the module docstring)."""
    rows, T = p.micro_batch_size, p.seq_len
    if rows * T >= GPU_MICRO_BATCH_TOKENS:
        return rows, micro_batches, f"{rows} × {T} tokens is already ≥ {GPU_MICRO_BATCH_TOKENS}"
    base = evaluate(p, micro_batches)
    if not base["gpu_fits"]:
        return rows, micro_batches, "the step does not fit the GPU as it is"
    best = (rows, micro_batches)
    for k in range(2, micro_batches + 1):
        if micro_batches % k:
            continue
        r = evaluate(replace(p, micro_batch_size=rows * k), micro_batches // k)
        worse = (
            "would not fit the GPU"
            if not r["gpu_fits"]
            else "would keep fewer blocks resident"
            if r["resident_blocks"] < base["resident_blocks"]
            else "would offload the saved activations"
            if r["offload_activations"] and not base["offload_activations"]
            else None
        )
        if worse:
            return (*best, f"{rows * k} rows a micro-batch {worse}")
        best = (rows * k, micro_batches // k)
        if rows * k * T >= GPU_MICRO_BATCH_TOKENS:
            return (
                *best,
                f"≥ {GPU_MICRO_BATCH_TOKENS} tokens a micro-batch: fewer, larger launches",
            )
    if best[1] == 1 and best[0] != rows:
        return (*best, f"the whole step in one micro-batch ({best[0] * T} tokens)")
    return (*best, f"{micro_batches} micro-batches a step cannot be merged further")


def shape_note(rows: int, m: int, seq_len: int, why: str, was: tuple[int, int]) -> str:
    """The run's start line for the chosen shape."""
    if (rows, m) == was:
        return f"micro-batch {rows} × {seq_len} tokens, {m} a step (kept: {why})"
    return (
        f"micro-batch {rows} × {seq_len} tokens, {m} a step, for the GPU (was {was[0]} × "
        f"{seq_len}, {was[1]} a step; the same {rows * m * seq_len} tokens a step): {why}; "
        "--micro-batch-size N keeps yours"
    )
