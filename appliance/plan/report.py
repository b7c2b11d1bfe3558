"""`appliance plan`'s answer: the plan as one JSON-able object (`make_plan`: the estimate at the
chosen micro-batches, with its problems and the fixes that would make it fit) and as text
(`format_plan`)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from appliance.hardware import gpus as hardware
from appliance.models import param_count
from appliance.plan.estimate import GiB, PlanInput, choose_micro_batches, evaluate
from appliance.plan.fixes import fixes, problems
from appliance.plan.shape import gpu_micro_batch


def make_plan(p: PlanInput) -> dict:
    """The whole plan as one JSON-able object (what `--json` prints)."""
    if p.micro_batches_per_step is None:
        m, why = choose_micro_batches(p)
    elif "micro_batches_per_step" in p.train_defaults:
        m, why = p.micro_batches_per_step, "train's default"
    else:
        m, why = p.micro_batches_per_step, "given"
    shape_why = "given"
    if "micro_batch_size" in p.train_defaults:  # the GPU's shape (plan/shape.py), as train's
        rows, m, shape_why = gpu_micro_batch(p, m)
        shape_why = f"train's default {p.micro_batch_size}, for the GPU: {shape_why}"
        if rows != p.micro_batch_size:
            why = f"{why}, merged {rows // p.micro_batch_size} to a micro-batch"
        p = replace(p, micro_batch_size=rows)
    r = evaluate(p, m)
    card = p.card
    result = {
        "model": p.model,
        "params": param_count(p.args),
        "gpu": p.gpu,
        "gpu_name": card.name,
        "gpus": p.gpus,
        "gpu_source": card.source,
        "gpu_paper_flops_per_second": card.paper_flops_per_second,
        "gpu_memory_bytes": card.memory_bytes,
        "base_quant": p.base_quant,
        "seq_len": p.seq_len,
        "micro_batch_size": p.micro_batch_size,
        "lora_rank": p.lora_rank,
        "micro_batches_per_step_why": why,
        "micro_batch_size_why": shape_why,
        "train_defaults": list(p.train_defaults),
        **r,
        "problems": problems(p, r),
        "fixes": [] if r["fits"] else fixes(p, m, r),
    }
    steps = p.steps
    if steps is None and p.tokens is not None:
        steps = math.ceil(p.tokens / r["tokens_per_step"])
    if steps is not None:
        seconds = steps * r["step_seconds_floor"]
        price = p.price_per_hour
        source = "--price-per-hour"
        if price is None:
            price = card.instance.usd_per_gpu_hour
            source = f"{card.instance.name} on-demand ({hardware.PRICES_AS_OF})"
        result.update(
            steps=steps,
            tokens=steps * r["tokens_per_step"],
            wall_seconds=seconds,
            usd_per_gpu_hour=price,
            price_source=source if price is not None else None,
            cost_usd=None if price is None else seconds / 3600 * price * p.gpus,
        )
    return result


# ---------------------------------------------------------------- output


def _b(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def format_plan(r: dict) -> str:
    """The plan for a person: host memory, GPU memory, time, cost, and the verdict."""
    g, h = r["gpu_bytes"], r["host_bytes"]
    L = r["blocks"]
    lines = [
        f"{r['model']}: {r['params'] / 1e9:.3g}B params, {L} blocks of {_b(r['block_bytes'])} "
        f"(base weights {r['base_quant']}) on {r['gpus']}× {r['gpu_name']}",
        "shape: " + ", ".join(_shape(r)),
        f"step: {r['micro_batches_per_step']} × {r['micro_batch_size']} × {r['seq_len']} = "
        f"{r['micro_batches_per_step'] * r['micro_batch_size'] * r['seq_len']} tokens per GPU, "
        f"{r['tokens_per_step']} per step",
        "",
        "Host memory (one node)",
        f"  weight store (/dev/shm)        {_b(h['weight_store'])}",
        f"  page-locked per trainer        {_b(h['page_locked_per_trainer'])}"
        " (the store's pages, registered in place, + offloaded activations)",
        f"  offloaded activations          {_b(h['offloaded_activations'])}",
        f"  trainer processes              {_b(h['trainer_processes'])} (assumed)",
        f"  tokenizer workers              {_b(h['tokenizer_workers'])} (assumed)",
        f"  needs: /dev/shm ≥ {_b(h['shm_needed'])}, RAM ≥ {_b(h['ram_needed'])}",
        "",
        f"GPU memory (per GPU, budget {_b(r['gpu_budget_bytes'])})",
        f"  resident blocks                {_b(g['resident_blocks'])} "
        f"({r['resident_blocks']} of {L} stay)",
        f"  streaming slots                {_b(g['streaming_slots'])}",
        f"  saved activations              {_b(g['activations'])}"
        + (" (offloaded to host)" if r["offload_activations"] else ""),
        f"  LoRA + AdamW state (fp32)      {_b(g['lora_optimizer'])}",
        f"  embeddings, norm, head         {_b(g['globals'])}",
        f"  working set (transient)        {_b(g['working_set'])}",
        f"  total                          {_b(g['total'])}",
        "",
        "Time (per optimizer step, per GPU)",
        f"  host→device                    {r['streamed_bytes_per_step'] / 1e9:.3g} GB "
        f"({r['blocks_uploaded_per_step']} block copies, both passes) at "
        f"B = {r['h2d_bytes_per_second'] / 1e9:.3g} GB/s → {r['h2d_seconds']:.3g} s",
        f"  compute F                      {r['flops_per_step'] / 1e12:.4g} TFLOP "
        f"({_flop_parts(r['flops_by_part'])}) at P = {r['flops_per_second'] / 1e12:.4g} TFLOP/s "
        f"→ {r['compute_seconds']:.3g} s",
        f"  floor max(bytes/B, F/P)        {r['step_seconds_floor']:.3g} s → "
        f"{r['tokens_per_second']:.4g} tokens/s (all GPUs)",
        f"  crossover T*                   {r['crossover_tokens_per_step']:.4g} tokens per GPU "
        "step (compute-bound above it)",
        _elementwise_line(r),
    ]
    lines += _moe_lines(r)
    lines += _full_lines(r)
    if "steps" in r:
        lines += [
            "",
            f"Run: {r['steps']} steps, {r['tokens']:.4g} tokens, {_dur(r['wall_seconds'])} at "
            "the floor (a lower bound)",
        ]
        if r["cost_usd"] is not None:
            lines.append(
                f"  cost ≥ ${r['cost_usd']:,.2f} at ${r['usd_per_gpu_hour']:.4g} per GPU-hour "
                f"({r['price_source']})"
            )
        else:
            lines.append(f"  cost: no on-demand price for {r['gpu']}; give --price-per-hour")
    lines.append("")
    if r["fits"]:
        lines.append("fits: yes")
    else:
        lines.append("fits: NO — " + "; ".join(r["problems"]))
        lines += [f"  fix: {f}" for f in r["fixes"]]
    return "\n".join(lines)


def _flop_parts(parts: dict) -> str:
    """F by part, the nonzero ones (engine/flops.py), e.g. "blocks 590, attention 35, head 7"."""
    names = ("blocks", "lora", "attention", "linear_attention", "head")
    return ", ".join(f"{k.replace('_', ' ')} {parts[k] / 1e12:.3g}" for k in names if parts[k])


def _elementwise_line(r: dict) -> str:
    """The step's least elementwise bytes over the card's memory bandwidth: beside the floor,
    not in it (engine/flops.py: elementwise_bytes)."""
    b, hbm = r["elementwise_bytes_per_step"], r["memory_bytes_per_second"]
    at = f" at {hbm / 1e9:.4g} GB/s → {b / hbm:.3g} s" if hbm else " (no memory bandwidth known)"
    return f"  elementwise, least (not in it) {b / 1e9:.3g} GB{at}"


def _shape(r: dict) -> list[str]:
    """The shape flags and where each came from (given, or train's default)."""
    out = []
    source = "train's default" if "seq_len" in r["train_defaults"] else "given"
    out.append(f"--seq-len {r['seq_len']} ({source})")
    out.append(f"--micro-batch-size {r['micro_batch_size']} ({r['micro_batch_size_why']})")
    m = r["micro_batches_per_step"]
    out.append(f"--micro-batches-per-step {m} ({r['micro_batches_per_step_why']})")
    return out


def run_plan(p: PlanInput, as_json: bool) -> dict:
    """Compute and print the plan; returns it."""
    r = make_plan(p)
    print(json.dumps(r, indent=2) if as_json else format_plan(r))
    return r


def _moe_lines(r: dict) -> list[str]:
    """A mixture of experts: the share of a streamed block's experts expected to move
    (plan/experts.py)."""
    m = r.get("moe")
    if m is None:
        return []
    if not m["streamed_by_expert"]:
        return [
            f"  experts moved                  all {m['experts']} (these blocks cross whole: "
            "experts fused in one tensor, or a quantized base)"
        ]
    return [
        f"  experts moved                  {m['expected_share']:.1%} of each streamed block's "
        f"{m['experts']} (top {m['top_k']}, T = {m['routed_tokens_per_block_pass']} routed "
        f"tokens per block pass: 1 − (1 − k/E)^T, routing assumed uniform); "
        f"{m['expected_share_per_copy']:.1%} per copy with the forward's prediction"
    ]


def _full_lines(r: dict) -> list[str]:
    """--finetuning-type full: the host's share of the step (plan/full.py)."""
    f = r.get("full_finetune")
    if f is None:
        return []
    h = f["host_bytes"]
    per = h["total"] / max(f["trained_parameters"], 1)
    return [
        "",
        f"Full fine-tune ({f['trained_parameters'] / 1e9:.3g}B trained parameters)",
        f"  host: weights {_b(h['weights'])}, fp32 master {_b(h['master'])}, AdamW moments "
        f"{_b(h['moments'])}, gradient buffers {_b(h['grad_buffers'])} (≈ {per:.0f} B/param)",
        f"  GPU gradient buffers           {_b(f['gpu_grad_bytes'])} (in globals above)",
        f"  device→host                    {f['d2h_bytes_per_step'] / 1e9:.3g} GB of fp32 "
        f"gradients → {f['d2h_seconds']:.3g} s",
        f"  CPU AdamW                      {f['optimizer_seconds']:.3g} s at "
        f"{f['adamw_params_per_second'] / 1e6:.0f} M params/s",
        f"  binds                          {f['binds']} (the floor is the longest; they overlap)",
    ]
