"""How fast a fresh Ray worker process copies into the object store: `ray.put` of one array,
again and again, against `np.copyto` of the same array into a warm buffer in the same process.

Why the WeightStore actor loads slower than the same loader in the driver (docs/benchmarks.md,
"One copy"): a worker maps the object store's shared memory without populating it, so each
4 KiB page it writes for the first time is a page fault. Rows: `keep` (every put kept: each lands
on new pages), `free` (each put dropped before the next: the store may reuse pages this process
has written). Each round is a new actor.

    python -m benchmarks.object_store_put --json put.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

MB = 10**6


def rates(nbytes: int, puts: int, keep: bool) -> dict:
    """Inside an actor: GB/s of each np.copyto and each ray.put of one `nbytes` array."""
    import ray

    src = np.ones(nbytes, np.uint8)
    dst = np.ones_like(src)
    copies = []
    for _ in range(puts):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(nbytes / (time.perf_counter() - t0) / 1e9)
    put, kept = [], []
    for _ in range(puts):
        t0 = time.perf_counter()
        ref = ray.put(src)
        put.append(nbytes / (time.perf_counter() - t0) / 1e9)
        if keep:
            kept.append(ref)
        else:
            del ref
            time.sleep(0.05)  # the store frees it
    return {"np_copyto_gb_s": copies, "ray_put_gb_s": put}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=116, help="array size in MB (a 1B block: 116)")
    ap.add_argument("--puts", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="actors per row")
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args(argv)
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=0)(rates)
        rows = []
        for r in range(a.rounds):
            for keep in (True, False):
                out = ray.get(remote.remote(a.mb * MB, a.puts, keep))
                rows.append({"round": r + 1, "puts": "keep" if keep else "free", **out})
    finally:
        ray.shutdown()
    print(
        f"| {a.mb} MB, {a.puts} each, a new actor per row | np.copyto GB/s (median) "
        "| ray.put GB/s (median) | ray.put min..max |"
    )
    print("|---|---:|---:|---|")
    for row in rows:
        p = row["ray_put_gb_s"]
        print(
            f"| round {row['round']}, {row['puts']} | "
            f"{statistics.median(row['np_copyto_gb_s']):.1f} | {statistics.median(p):.1f} | "
            f"{min(p):.1f}..{max(p):.1f} |"
        )
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"mb": a.mb, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
