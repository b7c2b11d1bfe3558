"""`appliance bench --load`: how fast the WeightStore loads a checkpoint, against reading its files.

    python -m appliance.bench.load --json load.json                  # makes a 1B-shaped checkpoint
    appliance bench --load --model DIR --quant none,nf4               # an existing checkpoint

Without --model it writes a Llama-3.2-1B-shaped bf16 checkpoint of random weights (≈2.5 GB,
sharded safetensors) into a temporary directory, and deletes it at the end. Then, in one run:

1. read: every safetensors file read start to end into a reused buffer, as `cat` would (the
   first pass warms the page cache; the best of the next passes is reported);
2. store: for each --quant, a WeightStore Ray actor (embedded Ray) loads the checkpoint into the
   object store; the time of its `handles()` call, the bytes it holds, and the actor's peak
   private memory (sampled; the object store's shared pages are not private) beside one block;
3. with --in-driver N: the same load N times in this process, the median after the first (whose
   puts, like every fresh actor's, fault in each object-store page it writes).

GB/s is checkpoint bytes / seconds for both, so the ratio store/read is the fraction of the disk
(page-cache) rate the store reaches. Then the quantizers alone: ns per value of the fused CPU
kernels (quant/cpu.py: C, what the store uses) and of the PyTorch functions, one thread, on one
(8192, 2048) bf16 weight (the 1B shape's MLP). Prints tables; --json writes every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from appliance import quant
from appliance.actors.weight_store import WeightStore
from appliance.bench.table import check_json_path, write_json
from appliance.engine.blocks import entry_nbytes
from appliance.errors import ConfigError
from appliance.hardware.host import SHM_DIR, tmpfs_huge_policy
from appliance.models.hf_checkpoint import expected_shapes, read_model_args
from appliance.quant import reference

GB = 1e9
READ_CHUNK = 16 * 2**20

# Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B), written here: nothing is downloaded
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def write_checkpoint(directory: Path, config: dict = LLAMA_1B, shard_bytes: int = 2**30) -> int:
    """Random bf16 weights of `config`'s shape as sharded safetensors; returns the bytes written.

    Values are N(0, 0.02) cut from one random pool at varying offsets (random weights for 1B
    parameters would take minutes to draw here; quantization cost does not depend on them)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    args = read_model_args(directory)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(2**24 + 3, generator=gen) * 0.02).to(torch.bfloat16)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    for k, (name, shape) in enumerate(expected_shapes(args).items()):
        n = math.prod(shape)
        if "norm" in name:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = pool.roll(k * 7919).repeat(-(-n // pool.numel()))[:n].view(shape).clone()
        if size + t.nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
        total += t.nbytes
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, directory / fname, metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def read_files(directory: Path) -> tuple[int, float]:
    """(bytes, seconds) to read every safetensors file once, `cat`-like (one reused buffer)."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def _anon_bytes(pid: int) -> int:
    """The process's private anonymous memory (RssAnon): its heap, not the object store's
    shared pages (RssShmem) nor the page cache of the files it reads (RssFile)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_private(pid: int, stop: threading.Event, out: list[int]) -> None:
    """Sample the process's RssAnon until `stop`; the peak goes into out[0]."""
    while not stop.is_set():
        try:
            out[0] = max(out[0], _anon_bytes(pid))
        except OSError:
            return
        time.sleep(0.005)


def _cpu_seconds(proc) -> float:
    """User + system CPU seconds of a psutil.Process so far (all its threads)."""
    return sum(proc.cpu_times()[:2])


def store_load(model_dir: Path, kind: str, threads: int | None) -> dict:
    """Load `model_dir` with a WeightStore Ray actor; its time, bytes and peak private memory."""
    import ray

    actor = ray.remote(num_cpus=0)(WeightStore).remote(str(model_dir), "bfloat16", kind, threads)
    try:
        import psutil

        pid = ray.get(actor.stats.remote())["pid"]  # the actor is up: time the load alone
        proc = psutil.Process(pid)
        base = _anon_bytes(pid)
        stop, peak = threading.Event(), [base]
        sampler = threading.Thread(target=_peak_private, args=(pid, stop, peak))
        sampler.start()
        cpu0 = _cpu_seconds(proc)
        t0 = time.perf_counter()
        handles = ray.get(actor.handles.remote())
        seconds = time.perf_counter() - t0
        cpu = _cpu_seconds(proc) - cpu0
        stop.set()
        sampler.join()
        block = max(sum(entry_nbytes(s, d) for _, s, d in i.values()) for i in handles.block_index)
        stats = ray.get(actor.stats.remote())
        return {
            "quant": kind,
            "seconds": seconds,
            "cpu_seconds": cpu,  # the actor process, all its threads (user + system)
            "store_bytes": handles.nbytes,
            "peak_private_bytes": peak[0] - base,  # RssAnon growth while loading
            "private_at_start_bytes": base,
            "quantized_block_bytes": block,
            # put straight from the files' pages, of all the buffers (the others assembled)
            "buffers_from_file": stats["buffers_from_file"],
            "buffers": len(handles.global_refs) + len(handles.block_refs),
        }
    finally:
        ray.kill(actor)


def driver_loads(model_dir: Path, kind: str, threads: int | None, loads: int) -> dict:
    """The same WeightStore load in this (the driver) process, `loads` times in a row, each
    load's objects freed before the next. The first writes object-store pages this process has
    not mapped yet (a page fault per 4 KiB, as every load in a fresh actor does); the later ones
    land on pages it has: what the loader costs without that."""
    import psutil

    me = psutil.Process()
    seconds, cpu_seconds = [], []
    for _ in range(loads):
        c0, t0 = _cpu_seconds(me), time.perf_counter()
        handles = WeightStore(model_dir, "bfloat16", kind, threads).handles()
        seconds.append(time.perf_counter() - t0)
        cpu_seconds.append(_cpu_seconds(me) - c0)
        store_bytes = handles.nbytes
        del handles  # its objects go before the next load
        time.sleep(0.5)
    return {
        "quant": kind,
        "seconds_each": seconds,  # [0]: the first, onto pages this process has not mapped
        "cpu_seconds_each": cpu_seconds,  # this process, all its threads (other work included)
        "seconds": statistics.median(seconds[1:]),
        "cpu_seconds": statistics.median(cpu_seconds[1:]),
        "store_bytes": store_bytes,
    }


def kernel_rates(kinds: list[str], repeats: int = 5) -> list[dict]:
    """ns per value of each quantizer on one (8192, 2048) bf16 weight, best of `repeats`, on one
    thread (the store runs one per reader thread): the fused kernel against the PyTorch one."""
    w = (torch.randn(8192, 2048, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    fused = reference._fused_kernels()
    impls = {
        "int8": {"torch": reference.quantize_int8},
        "nf4": {"torch": reference.quantize_nf4},
    }
    if fused is not None:
        impls["int8"]["fused"] = fused.quantize_int8
        impls["nf4"]["fused"] = lambda x: fused.quantize_nf4(x, reference.NF4_THRESHOLDS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for kind in (k for k in kinds if k in impls):  # in the order asked
            for name, fn in impls[kind].items():
                fn(w[:64])  # compiled / warm
                best = math.inf
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn(w)
                    best = min(best, time.perf_counter() - t0)
                row = {"quant": kind, "impl": name, "ns_per_value": best / w.numel() * 1e9}
                if name == "fused":
                    row["isa"] = fused.isa()
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def run(
    model: str | None,
    kinds: list[str],
    read_passes: int,
    threads: int | None,
    in_driver: int = 0,
) -> dict:
    import ray

    tmp = None
    if model is None:
        tmp = Path(tempfile.mkdtemp(prefix="appliance-load-bench-"))
        model_dir = tmp / "llama-3.2-1b-shaped"
        t0 = time.perf_counter()
        write_checkpoint(model_dir)
        made = time.perf_counter() - t0
    else:
        model_dir, made = Path(model), None
        if not model_dir.is_dir():
            raise ConfigError(f"--model {model}: not a directory")
    try:
        reads = [read_files(model_dir) for _ in range(read_passes + 1)][1:]  # first: warm-up
        ckpt_bytes = reads[0][0]
        read_s = min(s for _, s in reads)
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            # the first load into a fresh Ray node also faults in the object store's shared
            # pages (a cost of the node's first load only); the others reuse them
            first = {**store_load(model_dir, kinds[0], threads), "object_store": "cold"}
            rows = [first] + [
                {**store_load(model_dir, k, threads), "object_store": "warm"} for k in kinds
            ]
            driver = driver_loads(model_dir, kinds[0], threads, in_driver) if in_driver else None
        finally:
            ray.shutdown()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    read_rate = ckpt_bytes / read_s
    for r in rows + ([driver] if driver else []):
        r["gb_per_second"] = ckpt_bytes / r["seconds"] / GB
        r["ratio_to_read"] = ckpt_bytes / r["seconds"] / read_rate
        r["store_ratio_to_checkpoint"] = r["store_bytes"] / ckpt_bytes
    plain = next((r for r in rows[1:] if r["quant"] == "none"), None)
    if plain:
        for r in rows:
            r["time_vs_none"] = r["seconds"] / plain["seconds"]
            r["cpu_vs_none"] = r["cpu_seconds"] / plain["cpu_seconds"]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model or "Llama-3.2-1B shape, random bf16, made on the fly",
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_made_seconds": made,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),  # this machine is shared: wall times depend on it
        # the object store's pages: 2 MiB with huge=within_size|always, else 4 KiB (doctor)
        "shm_huge": tmpfs_huge_policy(Path(SHM_DIR)),
        "read": {"seconds": read_s, "gb_per_second": read_rate / GB, "passes": read_passes},
        "store": rows,
        "driver": driver,
        "kernels": kernel_rates(kinds),
    }


def format_table(result: dict) -> str:
    r = result["read"]
    lines = [
        f"checkpoint: {result['model']}, {result['checkpoint_bytes'] / GB:.2f} GB; "
        f"{result['cpus']} CPUs, load average {result['load_average'][0]:.1f}; "
        f"/dev/shm huge={result.get('shm_huge')}",
        "",
        "| load | seconds | CPU s | GB/s | × read | × none | store GB | peak heap MB | block MB "
        "| from file |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| read files (cat-like, warm) | {r['seconds']:.2f} | | {r['gb_per_second']:.2f} | 1 "
        "| | | | | |",
    ]
    for s in result["store"]:
        lines.append(
            f"| WeightStore actor, --base-quant {s['quant']} ({s['object_store']} store) | "
            f"{s['seconds']:.2f} | "
            f"{s['cpu_seconds']:.1f} | "
            f"{s['gb_per_second']:.2f} | {s['ratio_to_read']:.2f} | "
            f"{s.get('time_vs_none', float('nan')):.2f} | {s['store_bytes'] / GB:.2f} | "
            f"{s['peak_private_bytes'] / 2**20:.0f} | {s['quantized_block_bytes'] / 2**20:.0f} | "
            f"{s['buffers_from_file']}/{s['buffers']} |"
        )
    d = result.get("driver")
    if d:
        lines.append(
            f"| WeightStore in the driver, --base-quant {d['quant']} (median of loads 2..."
            f"{len(d['seconds_each'])}: its store mapping warm) | {d['seconds']:.2f} | "
            f"{d['cpu_seconds']:.1f} | {d['gb_per_second']:.2f} | {d['ratio_to_read']:.2f} | | "
            f"{d['store_bytes'] / GB:.2f} | | | |"
        )
    if result.get("kernels"):
        lines += ["", "| quantizer (1 thread, (8192, 2048) bf16) | ns/value |", "|---|---:|"]
        lines += [
            f"| {k['quant']} {k['impl']}{', ' + k['isa'] if k.get('isa') else ''} | "
            f"{k['ns_per_value']:.2f} |"
            for k in result["kernels"]
        ]
    return "\n".join(lines)


def parser(prog: str = "python -m appliance.bench.load") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a bf16 HF checkpoint (default: make a 1B one)")
    ap.add_argument("--quant", default="none,int8,nf4", help="--base-quant values to load with")
    ap.add_argument("--read-passes", type=int, default=2, help="timed file reads (after one)")
    ap.add_argument("--threads", type=int, default=None, help="WeightStore read threads")
    ap.add_argument(
        "--in-driver",
        type=int,
        default=0,
        metavar="N",
        help="also load N times (N >= 2) in this process, with the first --quant; the median of "
        "the loads after the first (this process's object-store mapping then warm)",
    )
    ap.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m appliance.bench.load") -> int:
    a = parser(prog).parse_args(argv)
    kinds = [k.strip() for k in a.quant.split(",") if k.strip()]
    try:
        bad = [k for k in kinds if k not in quant.KINDS]
        if bad or not kinds:
            raise ConfigError(f"--quant {a.quant!r}: each one of {', '.join(quant.KINDS)}")
        if a.in_driver == 1 or a.in_driver < 0:
            raise ConfigError(f"--in-driver {a.in_driver}: 0 (none) or at least 2 loads")
        if a.json_path:
            check_json_path(a.json_path)  # before minutes of loading, not after
        result = run(a.model, kinds, a.read_passes, a.threads, a.in_driver)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if a.json_path:
        write_json(result, a.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
