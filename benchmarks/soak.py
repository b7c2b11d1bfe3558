"""Soak: the demo for thousands of steps with frequent checkpoints, sampling every process's
memory (RSS and USS: the driver, the trainer, the weight store, the tokenizer workers, Ray's GCS
and raylet and its other helpers) and writing each one's growth per step to JSON. Not a timed
test: a benchmark whose table goes into docs/benchmarks.md ("Soak").

    python -m benchmarks.soak --steps 3000 --checkpoint-every 10 --json soak.json

The run is a real `appliance train` (the built-in demo, --log-format json) in its own session;
every `--every` seconds each process of that session is sampled (psutil: rss, and uss, the
memory no other process shares). A process's growth per step is the least-squares slope of its
memory against the run's step over the samples taken after `--warmup` steps (loading the model,
the first checkpoints and compiling are not growth).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil

#: a process's role, by what its command line holds (Ray names its actors' processes ray::Class)
ROLES = (
    ("trainer", "ray::Trainer"),
    ("weight store", "ray::WeightStore"),
    ("tokenizer worker", "ray::TokenizeWorker"),
    ("tokenizer worker", "ray::ShardWorker"),
    ("gcs_server", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard agent", "dashboard/agent.py"),
    ("dashboard agent", "ray::DashboardAgent"),
    ("runtime env agent", "ray::RuntimeEnvAgent"),
    ("runtime env agent", "runtime_env/agent/main.py"),
    ("log monitor", "log_monitor.py"),
    ("idle worker", "default_worker.py"),
)


def role(proc: psutil.Process, driver: int) -> str | None:
    if proc.pid == driver:
        return "driver"
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return next((name for name, needle in ROLES if needle in cmd), None)


def sample(driver: int) -> dict[str, dict[str, int]]:
    """{role#pid: {rss, uss}} of every process of the run's session."""
    out = {}
    sid = os.getsid(driver)
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) != sid:
                continue
            name = role(proc, driver)
            if name is None:
                continue
            mem = proc.memory_full_info()
            out[f"{name}#{proc.pid}"] = {"rss": mem.rss, "uss": mem.uss}
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
            continue
    return out


def slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares bytes per step of (step, bytes) points; None with fewer than 3."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(b for _, b in points) / n
    var = sum((s - mx) ** 2 for s, _ in points)
    return sum((s - mx) * (b - my) for s, b in points) / var if var else None


def run(args: argparse.Namespace) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    command = [
        sys.executable, "-m", "appliance", "train", "--output", str(out_dir / "run"),
        "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
        "--log-format", "json",
    ]  # fmt: skip
    p = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    step = [0]

    def read_steps() -> None:
        for line in p.stdout:  # one JSON object a step
            m = re.match(r'\{"step": (\d+)', line)
            if m:
                step[0] = int(m.group(1))

    reader = threading.Thread(target=read_steps, daemon=True)
    reader.start()
    samples: list[tuple[int, float, dict]] = []
    t0 = time.monotonic()
    try:
        while p.poll() is None:
            samples.append((step[0], time.monotonic() - t0, sample(p.pid)))
            time.sleep(args.every)
    except KeyboardInterrupt:
        os.killpg(p.pid, signal.SIGINT)
        p.wait()
    reader.join(timeout=10)
    seconds = time.monotonic() - t0
    processes: dict[str, dict] = {}
    for at, _, procs in samples:
        for key, mem in procs.items():
            entry = processes.setdefault(key, {"points": []})
            entry["points"].append((at, mem["rss"], mem["uss"]))
    table = {}
    for key, entry in sorted(processes.items()):
        pts = [pt for pt in entry["points"] if pt[0] >= args.warmup]
        if not pts:
            continue
        table[key] = {
            "samples": len(pts),
            "first_step": pts[0][0],
            "last_step": pts[-1][0],
            "rss_first": pts[0][1],
            "rss_last": pts[-1][1],
            "uss_first": pts[0][2],
            "uss_last": pts[-1][2],
            "rss_bytes_per_step": slope([(s, r) for s, r, _ in pts]),
            "uss_bytes_per_step": slope([(s, u) for s, _, u in pts]),
        }
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, "
        f"{psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "command": " ".join(command[1:]),
        "exit_code": p.returncode,
        "steps": step[0],
        "seconds": round(seconds, 1),
        "warmup_steps": args.warmup,
        "processes": table,
    }


def markdown(result: dict) -> str:
    rows = [
        "| process | steps sampled | RSS first → last (MiB) | RSS growth / step | "
        "USS growth / step |",
        "|---|---|---|---|---|",
    ]
    for key, e in result["processes"].items():

        def per_step(v: float | None) -> str:
            return "-" if v is None else f"{v / 1024:+.2f} KiB"

        rows.append(
            f"| {key.split('#')[0]} | {e['first_step']}–{e['last_step']} | "
            f"{e['rss_first'] / 2**20:.0f} → {e['rss_last'] / 2**20:.0f} | "
            f"{per_step(e['rss_bytes_per_step'])} | {per_step(e['uss_bytes_per_step'])} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--warmup", type=int, default=200, help="steps left out of the slope")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(markdown(result))
    if result["exit_code"] != 0:
        sys.exit(f"the run exited {result['exit_code']}")


if __name__ == "__main__":
    main()
