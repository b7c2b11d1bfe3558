"""The bench's report: a result (step.run_bench) as a header and a Markdown table, and as
JSON."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from appliance.engine.issue_lag import PASSES
from appliance.errors import ConfigError
from appliance.hardware.measure import GiB


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _g(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}"


def format_table(result: dict) -> str:
    """The result as a header and a Markdown table (what `print_table` prints)."""
    m, s = result["model"], result["shape"]
    budget = result["gpu_memory_budget"]
    lines = [
        f"preset {result['preset']}: {m['num_layers']} layers, hidden {m['hidden_size']}, "
        f"{_count(m['params'])} params, {result['dtype']} on {result['device_name']}"
        + (", blocks compiled (torch.compile)" if result.get("compile_blocks") else ""),
        f"B = {result['bandwidth']['bytes_per_second'] / 1e9:.3g} GB/s "
        f"({result['bandwidth']['kind']})",
        f"P = {result['matmul']['flops_per_second'] / 1e12:.3g} TFLOP/s "
        f"({result['matmul']['kind']})",
        f"tokens/step = {s['micro_batches']} micro-batches × {s['micro_batch_size']} × "
        f"{s['seq_len']} = {s['tokens_per_step']}; {s['warmup']} warm-up + {s['steps']} timed "
        f"steps; GPU memory budget: {f'{budget / GiB:.3g} GiB' if budget else 'none'}"
        + (
            f" ({result['gpu_memory_budget_kind']})" if result.get("gpu_memory_budget_kind") else ""
        ),
        "",
        "| mode | tokens/step | step s | tokens/s | W GB | B GB/s | W/B s | F TFLOP | F/P s "
        "| floor s | time/floor | h2d stall | dequant | GPU busy | NVML util |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["modes"]:
        if not r["fits"]:
            lines.append(f"| {r['mode']} | {r['tokens_per_step']} | {r['reason']} |" + " — |" * 12)
            continue
        stall = r["h2d_stall_seconds_per_step"] / r["step_seconds"]
        busy = "—" if r["gpu_busy_ratio"] is None else f"{r['gpu_busy_ratio']:.0%}"
        nvml = "—" if r.get("nvml_util_mean") is None else f"{r['nvml_util_mean']:.0%}"
        lines.append(
            f"| {r['mode']} | {r['tokens_per_step']} | {_g(r['step_seconds'])} "
            f"| {_g(r['tokens_per_second'])} | {_g(r['streamed_bytes'] / 1e9)} "
            f"| {_g(r['bandwidth_bytes_per_second'] / 1e9, 3)} "
            f"| {_g(r['floor_h2d_seconds'])} | {_g(r['flops_per_step'] / 1e12)} "
            f"| {_g(r['floor_compute_seconds'])} | {_g(r['floor_seconds'])} | {r['ratio']:.2f} "
            f"| {stall:.1%} | {r['dequant_share']:.1%} | {busy} | {nvml} |"
        )
    streamed = [r for r in result["modes"] if r["fits"] and r["streamed_bytes"]]
    for r in streamed:
        lines.append(
            f"\n{r['mode']}: T* = {r['crossover_tokens_per_step']:.0f} tokens per step (W/B = F/P; "
            f"this run: {r['tokens_per_step']}, "
            + (
                "compute-bound)"
                if r["tokens_per_step"] >= r["crossover_tokens_per_step"]
                else "copy-bound)"
            )
        )
    for r in result["modes"]:  # beside the floor, not in it (engine/flops.py)
        if r["fits"] and r.get("floor_elementwise_seconds") is not None:
            parts = ", ".join(
                f"{k.replace('_', ' ')} {v / 1e12:.3g}"
                for k, v in r["flops_by_part"].items()
                if v and k != "total"
            )
            lines.append(
                f"{r['mode']}: F by part (TFLOP): {parts}; least elementwise bytes "
                f"{r['elementwise_bytes_per_step'] / 1e9:.3g} GB at "
                f"{result['memory_bandwidth']['bytes_per_second'] / 1e9:.3g} GB/s → "
                f"{r['floor_elementwise_seconds']:.3g} s (not in the floor)"
            )
    for r in result["modes"]:
        if r["fits"] and (f := r.get("full_finetune")):  # --finetuning-type full
            lines.append(
                f"{r['mode']}: full fine-tune, {f['trained_parameters'] / 1e6:.4g}M parameters: "
                f"{f['d2h_bytes_per_step'] / 1e9:.4g} GB of gradients device→host (floor "
                f"{f['floor_d2h_seconds']:.4g} s); CPU AdamW {f['optimizer_host_seconds_per_step']:.4g}"
                f" s a step, of which the step waited {f['optimizer_exposed_seconds_per_step']:.4g} s"
            )
    for r in result["modes"]:
        if r["fits"] and r.get("expert_share") is not None:  # MoE, streamed by expert
            lines.append(
                f"{r['mode']}: {r['expert_share']:.1%} of each streamed block's experts copied "
                f"per copy; {_g(r['h2d_bytes_per_step'] / 1e9)} GB copied a step (W counts "
                "whole blocks)"
            )
    for r in result["modes"]:
        if r["fits"] and r.get("host_issue_ratio") is not None:
            lines.append(
                f"{r['mode']}: the host issued work for {r['host_issue_ratio']:.0%} of the step"
                + _bound(r)
            )
    for r in result["modes"]:
        if r["fits"] and (lag := r.get("issue_lag")):
            lines.append(f"{r['mode']}: " + lag_line(lag))
    return "\n".join(lines)


def lag_line(lag: dict) -> str:
    """engine/issue_lag.py's figures in a line: near zero, launch-bound; growing, GPU-bound."""
    growth = "; ".join(
        f"through the {p} {lag[p]['growth_seconds'] * 1e3:+.1f} ms" for p in PASSES if p in lag
    )
    return (
        f"the GPU finished each block {lag['median_seconds'] * 1e3:.3g} ms (median; max "
        f"{lag['max_seconds'] * 1e3:.3g}) after the host issued it; growth {growth} "
        "(near zero: launch-bound; growing: GPU-bound)"
    )


def _bound(row: dict) -> str:
    """What a host busy for most of the step means. Not, alone, that the GPU waited for it: the
    host also blocks in a launch once CUDA's queue is full, so a GPU-bound step keeps it busy too
    (H100, 2026-11-27: 99% at 70b, NVML 93%, and at 7b, NVML 75%). NVML's utilization (the share
    of time a kernel ran) tells the two apart where it was sampled."""
    if row["host_issue_ratio"] <= 0.9:
        return ""
    nvml = row.get("nvml_util_mean")
    if nvml is None:
        return " (launch-bound, or GPU-bound with the launch queue full: no NVML reading to tell)"
    if nvml < 0.9:
        return (
            f" and NVML saw no kernel running {1 - nvml:.0%} of it (launch-bound: the GPU waited "
            "for the host; GPU busy overstates its work)"
        )
    return f" (waiting on the full launch queue: NVML saw kernels running {nvml:.0%} of it)"


def print_table(result: dict) -> None:
    print(format_table(result))


def check_json_path(path: str | Path, flag: str = "--json") -> None:
    """Before the bench runs: ConfigError naming `flag` unless write_json can write `path`. Its
    missing parent directories are no error: write_json makes them, as export makes its
    --output's."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{flag} {path} is a directory; give a file name, e.g. {flag} {path / 'bench.json'}"
        )
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(
            f"{flag} {path}: {blocker} is a file, not a directory; give a path under a directory"
        )
    there = next(p for p in path.parents if p.exists())  # "." or "/" at worst
    if not os.access(there, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {there} is not writable; choose another path")


def write_json(result: dict, path: str | Path) -> None:
    """Write `result` whole or not at all (a temp file renamed): a bench killed while writing
    keeps the previous rows' file. Missing parent directories are made; the temp file never
    stays behind, whatever fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
