"""The bench's command line: `python -m appliance.bench` and `appliance bench` parse the same
options (`parser`) and run `step.run_bench` with them (`run_from_args`); bench/step.py says what is
measured."""

from __future__ import annotations

import argparse
import sys

from appliance.actors.trainer import resolve_device
from appliance.bench.step import MODES, run_bench
from appliance.bench.table import check_json_path, print_table, write_json
from appliance.config import parse_bytes
from appliance.engine.blocks import dtype_from_name
from appliance.engine.memory import gpu_budget_problem
from appliance.errors import ConfigError
from appliance.models.presets import PRESETS, presets_help


def parser(prog: str = "python -m appliance.bench") -> argparse.ArgumentParser:
    """The one parser of the bench's options: `python -m appliance.bench` and `appliance bench`."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Time the streamed step against its floor max(W/B_h2d, F/P) and against "
        "resident training, on a preset model shape. Prints a table; --json also writes it.",
        epilog=presets_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset", choices=list(PRESETS), default="tiny", help="Model shape (below). [tiny]"
    )
    ap.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto takes CUDA when a GPU is visible. [auto]",
    )
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="Compute dtype: auto is bfloat16 on GPU (float16 without bf16), float32 on CPU. "
        "[auto]",
    )
    ap.add_argument(
        "--gpu-memory-budget",
        default=None,
        metavar="SIZE",
        help="Cap GPU memory, e.g. 24GiB: blocks beyond it stream (the streamed row).",
    )
    ap.add_argument(
        "--micro-batch-size", type=int, default=None, metavar="N", help="Rows per micro-batch."
    )
    ap.add_argument("--seq-len", type=int, default=None, metavar="N", help="Tokens per row.")
    ap.add_argument(
        "--micro-batches-per-step",
        "--micro-batches",  # the older spelling, still accepted
        dest="micro_batches",
        type=int,
        default=None,
        metavar="N",
        help="Micro-batches per optimizer step (as train's flag).",
    )
    ap.add_argument("--steps", type=int, default=None, metavar="N", help="Timed steps.")
    ap.add_argument(
        "--warmup", type=int, default=None, metavar="N", help="Untimed steps before them."
    )
    ap.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="FILE",
        help="Also write the results here as JSON.",
    )
    ap.add_argument(
        "--base-quant",
        choices=["none", "int8", "nf4"],
        default="none",
        help="Quantize the blocks' linear weights, as train --base-quant. [none]",
    )
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        metavar="LIST",
        help="Rows to run: streamed, resident or both. [streamed,resident]",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="Profile one more step per row (torch.profiler): its top operators by self time, "
        "printed and in the JSON.",
    )
    ap.add_argument(
        "--finetuning-type",
        choices=["lora", "full"],
        default="lora",
        help="full: every weight trains, AdamW on the host (train --finetuning-type full). [lora]",
    )
    ap.add_argument(
        "--compile-blocks",
        action="store_true",
        help="Run the blocks through torch.compile, as train --compile-blocks.",
    )
    ap.add_argument(
        "--kernels",
        choices=["exact", "fast"],
        default="exact",
        help="The block kernels' tier, as train --kernels: exact (bitwise transformers + PEFT) "
        "| fast (held to the fast tier's accuracy rule). [exact]",
    )
    return ap


def run_from_args(a: argparse.Namespace) -> dict:
    """Run the bench for parsed options: prints the table, writes the JSON if asked.

    ConfigError for a bad option value (naming the flag)."""

    if a.json_path:  # before the bench runs, not after it (its results then lost)
        check_json_path(a.json_path)
    device = resolve_device(a.device)
    try:
        budget = parse_bytes(a.gpu_memory_budget) if a.gpu_memory_budget else None
    except ValueError as e:
        raise ConfigError(f"--gpu-memory-budget {a.gpu_memory_budget!r}: {e}") from None
    problem = None if budget is None else gpu_budget_problem(a.gpu_memory_budget, budget)
    if problem:  # 0, or 24 read as 24 bytes: plan's rule
        raise ConfigError(problem)
    names = ("micro_batch_size", "seq_len", "micro_batches", "steps", "warmup")
    shape = {k: getattr(a, k) for k in names if getattr(a, k) is not None}
    dtype = dtype_from_name(a.dtype) if a.dtype != "auto" else None
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    unwritten: list[str] = []

    def write_rows(partial: dict) -> None:  # a failed write (a full disk) ends no bench
        try:
            write_json(partial, a.json_path)
            unwritten.clear()  # the file holds every row so far
        except OSError as e:
            unwritten[:] = [
                f"--json {a.json_path}: not written ({e.strerror or e}); the table above holds "
                "the results"
            ]

    result = run_bench(
        a.preset,
        device,
        dtype,
        budget,
        **shape,
        base_quant=a.base_quant,
        profile=a.profile,
        compile_blocks=a.compile_blocks,
        kernels=a.kernels,
        modes=modes,
        finetuning_type=a.finetuning_type,
        on_row=write_rows if a.json_path else None,
    )
    print_table(result)
    for row in result["modes"]:
        if row.get("profile"):
            print(f"\n{row['mode']}: one step under torch.profiler\n{row['profile']}")
    if unwritten:
        raise ConfigError(unwritten[0])
    return result


def main(argv: list[str] | None = None, prog: str = "python -m appliance.bench") -> int:
    """Parse `argv`, run, return the exit status (user errors: one `error:` line, status 1)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--load" in argv:  # the WeightStore load benchmark (bench/load.py), its own options
        from appliance.bench.load import main as load_main

        return load_main([x for x in argv if x != "--load"], prog=f"{prog} --load")
    a = parser(prog).parse_args(argv)
    try:
        run_from_args(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
