"""The comparison table of issue 10: appliance streamed and resident against the peers.

On the GPU run (docs/benchmarks.md, "Peers: how they are run"), after the three runs:

    PYTHONPATH=$PWD python -m appliance.bench --preset 13b --gpu-memory-budget 24GiB --json appliance-13b.json
    PYTHONPATH=$PWD python -m benchmarks.peer_fsdp2_offload --preset 13b --json fsdp2-13b.json
    PYTHONPATH=$PWD python -m benchmarks.peer_hf_peft --preset 13b --json hf-13b.json
    python -m benchmarks.compare --appliance appliance-13b.json \\
        --peer fsdp2-13b.json --peer hf-13b.json --out compare-13b.md

Reads the JSON of `appliance bench --json` (its `modes`: streamed, resident) and of the peer
scripts (benchmarks/peer_*.py), prints a Markdown table (system, shape, tokens/step, step s,
tokens/s, peak GPU GiB, appliance streamed's tokens/s over the row's) and the two ratios the issue
asks for (streamed ≥ 0.9× resident's throughput; ≥ 3× FSDP2-offload's), and writes it all to
`--out`. `step s` is the mean of the timed steps in every row (the bench's `step_seconds`; the
peers report the same mean, their median is in their JSON). Runs that do not train the same
tokens (preset, device, dtype or step shape differ) are flagged above the table. Needs only the
standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GiB = 2**30
# (row system, target of appliance streamed's tokens/s over the row's, what the issue says)
TARGETS = (
    ("appliance-resident", 0.9, "streamed ≥ 0.9× resident throughput"),
    ("fsdp2-offload", 3.0, "streamed ≥ 3× FSDP2-offload throughput"),
)
SHAPE_KEYS = ("micro_batch_size", "seq_len", "micro_batches", "tokens_per_step")


def _g(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}"


def appliance_rows(bench: dict) -> list[dict]:
    """The bench's modes as rows: system, label, shape, fits/reason, step_seconds, tokens/s,
    peak_gpu_bytes (None where the bench did not record it)."""
    budget = bench.get("gpu_memory_budget")
    rows = []
    for m in bench["modes"]:
        label = f"appliance, {m['mode']}"
        if m["mode"] == "streamed" and budget:
            label += f" (GPU budget {budget / GiB:.3g} GiB)"
        rows.append(
            {
                "system": f"appliance-{m['mode']}",
                "label": label,
                "shape": bench["shape"],
                "fits": m["fits"],
                "reason": m.get("reason"),
                "step_seconds": m.get("step_seconds"),
                "tokens_per_second": m.get("tokens_per_second"),
                "peak_gpu_bytes": m.get("peak_gpu_bytes"),
            }
        )
    return rows


def peer_row(peer: dict) -> dict:
    return {k: peer.get(k) for k in ("system", "label", "shape", "fits", "reason")} | {
        "step_seconds": peer.get("step_seconds"),
        "tokens_per_second": peer.get("tokens_per_second"),
        "peak_gpu_bytes": peer.get("peak_gpu_bytes"),
    }


def mismatches(bench: dict, peers: list[dict]) -> list[str]:
    """What makes a peer run not comparable with the bench run (empty: the same tokens)."""
    out = []
    for p in peers:
        for key in ("preset", "device", "dtype"):
            if p.get(key) != bench.get(key):
                out.append(f"{p['system']}: {key} {p.get(key)!r}, the bench's {bench.get(key)!r}")
        for key in SHAPE_KEYS:
            if p["shape"].get(key) != bench["shape"].get(key):
                out.append(
                    f"{p['system']}: shape {key} {p['shape'].get(key)}, "
                    f"the bench's {bench['shape'].get(key)}"
                )
    return out


def ratio_lines(rows: list[dict]) -> list[str]:
    """Appliance streamed's throughput over each targeted row's, against the issue's target."""
    by = {r["system"]: r for r in rows}
    streamed = by.get("appliance-streamed")
    lines = []
    for system, target, says in TARGETS:
        row = by.get(system)
        if row is None:
            lines.append(f"- {says}: no {system} run given")
        elif streamed is None or not streamed["fits"]:
            lines.append(f"- {says}: the streamed run did not run")
        elif not row["fits"]:
            lines.append(f"- {says}: {system} does not fit ({row['reason']})")
        else:
            r = streamed["tokens_per_second"] / row["tokens_per_second"]
            verdict = "met" if r >= target else "NOT met"
            lines.append(f"- {says}: {r:.2f}× — {verdict}")
    return lines


def format_table(bench: dict, peers: list[dict]) -> str:
    s = bench["shape"]
    rows = appliance_rows(bench) + [peer_row(p) for p in peers]
    streamed = next((r for r in rows if r["system"] == "appliance-streamed"), None)
    base = streamed["tokens_per_second"] if streamed and streamed["fits"] else None
    devices = sorted({bench.get("device_name", "?")} | {p.get("device_name", "?") for p in peers})
    lines = [
        f"preset {bench['preset']} ({bench['model']['num_layers']} layers, hidden "
        f"{bench['model']['hidden_size']}), {bench['dtype']} on {'; '.join(devices)}; "
        f"LoRA r{bench['lora']['rank']} alpha {bench['lora']['alpha']:g} on "
        f"{','.join(bench['lora']['targets'])}; step s = mean of the timed steps",
    ]
    bad = mismatches(bench, peers)
    if bad:
        lines += ["", "**Not the same tokens — not comparable:**"] + [f"- {b}" for b in bad]
    lines += [
        "",
        "| system | shape | tokens/step | step s | tokens/s | peak GPU GiB "
        "| streamed tokens/s ÷ this |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sh = r["shape"]
        shape = f"{sh['micro_batches']}×{sh['micro_batch_size']}×{sh['seq_len']}"
        head = f"| {r['label']} | {shape} | {sh['tokens_per_step']} "
        if not r["fits"]:
            lines.append(head + f"| does not fit: {r['reason']} | — | — | — |")
            continue
        peak = r["peak_gpu_bytes"]
        peak_s = _g(peak / GiB, 3) if peak is not None else "—"
        ratio = f"{base / r['tokens_per_second']:.2f}" if base else "—"
        lines.append(
            head + f"| {_g(r['step_seconds'])} | {_g(r['tokens_per_second'])} | {peak_s} "
            f"| {ratio} |"
        )
    lines += ["", f"Issue 10's targets ({s['tokens_per_step']} tokens/step in every row):"]
    lines += ratio_lines(rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="Markdown table: appliance bench (streamed, resident) against the peers.",
    )
    ap.add_argument("--appliance", required=True, metavar="FILE", help="appliance bench --json")
    ap.add_argument(
        "--peer", action="append", default=[], metavar="FILE", help="A peer's --json (repeat)."
    )
    ap.add_argument(
        "--out", default=None, metavar="FILE", help="Write the table here. [compare-PRESET.md]"
    )
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(a.appliance).is_file():
        print(f"error: {a.appliance}: no such file (did appliance bench finish?)", file=sys.stderr)
        return 1
    bench = json.loads(Path(a.appliance).read_text())
    if "modes" not in bench:
        print(f"error: {a.appliance} is not appliance bench --json output", file=sys.stderr)
        return 1
    peers = []
    for path in a.peer:
        if not Path(path).is_file():  # that peer died (gpu_proof.sh goes on): the rest compare
            print(
                f"warning: {path}: no such file (did the peer finish?); left out", file=sys.stderr
            )
            continue
        p = json.loads(Path(path).read_text())
        if "system" not in p:
            print(f"error: {path} is not a peer script's --json output", file=sys.stderr)
            return 1
        peers.append(p)
    table = format_table(bench, peers)
    print(table, end="")
    out = Path(a.out or f"compare-{bench['preset']}.md")
    out.write_text(table)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
